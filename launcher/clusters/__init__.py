"""Where a job runs: what SLURM, Kubernetes (Kubeflow, JobSet, Indexed Job), SkyPilot and a TPU
pod say about a run's nodes, read from the environment they set, and the batch scripts and
manifests that start `train` there (`train slurm`, `train k8s`).

Only the `train` process (`launcher.launch`) and the command line (`launcher.cli`) import this
room; it imports only the error types, the spec and the run folder, and never torch."""

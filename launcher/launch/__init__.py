"""What runs in the `train` process: the plan, the elastic agent, supervision, the live display
and failure reports. Nothing here imports `launcher.worker`: the workers' code is started in
their own processes, by module name."""

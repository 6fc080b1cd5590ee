"""What runs in every worker process: the worker's entry point, the one training loop, the
strategies, checkpoints and data. Nothing here imports `launcher.launch`."""

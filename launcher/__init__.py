"""launcher: `train --config run.yaml` for PyTorch DDP, FSDP and XLA, with live per-replica logs."""

__version__ = "0.1.0"

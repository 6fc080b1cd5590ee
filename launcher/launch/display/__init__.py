"""Live, per-replica log display: each rank's lines, prefixed and coloured, plus status."""

from launcher.launch.display.console import RunDisplay

__all__ = ["RunDisplay"]

"""The two kinds of failure the CLI reports without a traceback.

A `UsageError` is the user's input (spec, flag, path): exit code 2. A `RunError` is something
that went wrong while running: exit code 1. Anything else is a bug in the launcher and gets a
traceback.
"""

from __future__ import annotations

INTERRUPTED = 130  # the shell's code for a process ended by SIGINT: Ctrl-C's exit code


class LauncherError(Exception):
    exit_code = 1

    def __init__(self, message: str, *, details: list[str] | None = None, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.details = details or []
        self.hint = hint

    def render(self) -> str:
        lines = [self.message, *(f"  {d}" for d in self.details)]
        if self.hint:
            lines.append(self.hint)
        return "\n".join(lines)


class UsageError(LauncherError):
    exit_code = 2


class RunError(LauncherError):
    exit_code = 1

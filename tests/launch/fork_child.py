"""A program the fork server tests fork (`python -m tests.launch.fork_child WHAT ...`):
`exit N`, `sleep S`, or `report FILE` (its working directory, environment and streams)."""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str]) -> None:
    what, value = argv
    if what == "exit":
        sys.exit(int(value))
    if what == "sleep":
        time.sleep(float(value))
        return
    print("to stdout")
    print("to stderr", file=sys.stderr)
    report = {"cwd": os.getcwd(), "env": dict(os.environ), "argv": sys.argv, "main": __name__}
    with open(value, "w") as out:
        json.dump(report, out)


if __name__ == "__main__":
    main(sys.argv[1:])

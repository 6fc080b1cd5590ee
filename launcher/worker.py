"""One replica: `python -m launcher.worker --run-dir DIR --spec FILE --accelerator cpu`.

Started by torch.distributed's elastic agent, which sets RANK, WORLD_SIZE and friends. The first
thing it does is point its own stdout and stderr, at the file-descriptor level, into its log
file, so that output from C/C++ code lands there too and the launcher can follow every rank.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def redirect_output(log_file: Path) -> None:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_file, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    # A killed earlier attempt may have left half a line; start ours on a line of its own.
    if os.fstat(fd).st_size and os.pread(fd, 1, os.fstat(fd).st_size - 1) != b"\n":
        os.write(fd, b"\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Line buffering: the launcher shows lines as they are written, not when a buffer fills.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="launcher.worker")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--accelerator", required=True)
    parser.add_argument("--resume", type=Path, default=None)
    return parser.parse_args(argv)


def die_with_parent() -> None:
    """The agent starts workers in sessions of their own; if it is killed (even by SIGKILL),
    the kernel kills this worker too instead of leaving it training on its own."""
    if sys.platform != "linux":
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    args = _parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    redirect_output(args.run_dir / "logs" / f"rank-{rank}.log")

    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_train)(args)


def _train(args: argparse.Namespace) -> int:
    from launcher.errors import LauncherError
    from launcher.loop import Trainer
    from launcher.recipe import load_recipe
    from launcher.spec_loader import load_spec
    from launcher.strategies import build_strategy

    spec = load_spec(args.spec)
    strategy = build_strategy(spec.launch.strategy, args.accelerator, spec.train.precision)
    try:
        strategy.setup()
        # torch.distributed prefixes tracebacks with "[rankN]:"; the display already says which
        # rank, and a prefixed "Traceback" line would hide the block from the alert filter.
        sys.excepthook = sys.__excepthook__
        trainer = Trainer(spec, load_recipe(spec.recipe.source), strategy, args.run_dir)
        trainer.fit(resume_from=args.resume)
    except LauncherError as exc:
        print(f"error: {exc.render()}", file=sys.stderr, flush=True)
        return exc.exit_code
    finally:
        strategy.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

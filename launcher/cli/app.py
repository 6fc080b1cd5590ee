"""`train`: the command line. It parses, builds a plan, and calls one function.

`train --config run.yaml` runs; `train validate|slurm|k8s|export|schema|runs|plot ...` are the other
commands (COMMANDS). Nothing is imported at the top that imports torch: `--help`, a bad flag or
a spec with mistakes answer in a fraction of a second, and torch comes in once a run needs it.
"""

from __future__ import annotations

from launcher.cli import interrupt  # noqa: F401  (first: Ctrl-C during the imports below)

# isort: split
import difflib
import sys
from collections.abc import Callable
from typing import Any

import typer
from rich.text import Text
from typer.core import TyperCommand, TyperGroup

from launcher.cli.export import export_command
from launcher.cli.k8s import k8s_command
from launcher.cli.options import err
from launcher.cli.plot import plot_command
from launcher.cli.run import run_command
from launcher.cli.runs import runs_command
from launcher.cli.schema import schema_command
from launcher.cli.slurm import slurm_command
from launcher.cli.validate import validate_command
from launcher.launch.closed_output import flush_standard_streams

# name -> (function, the one line `train --help` lists it with)
COMMANDS: dict[str, tuple[Callable[..., None], str]] = {
    "validate": (
        validate_command,
        "check a spec and its recipe; --explain: where each value came from",
    ),
    "slurm": (slurm_command, "print an sbatch script for a SLURM cluster"),
    "k8s": (k8s_command, "print a Kubernetes manifest: a Kubeflow PyTorchJob or a JobSet"),
    "export": (
        export_command,
        "write a checkpoint's model as one .safetensors or .pt file, or a Hugging Face folder",
    ),
    "schema": (schema_command, "print the spec's JSON Schema, for editors"),
    "runs": (runs_command, "list the runs: status, steps, losses, checkpoints"),
    "plot": (plot_command, "draw runs' curves: a PNG, or in the terminal"),
}

EXAMPLES = """
Examples:

  train --config configs/quickstart.yaml

  train --config configs/quickstart.yaml --devices 2 --accelerator cpu

  train --config my_run.yaml --devices 4 optim.lr=3e-4 train.max_steps=500

  train --config my_run.yaml --resume latest

  train --config my_run.yaml --nnodes 2 --node-rank 0 --rdzv-endpoint node01:29500 --rdzv-id exp42

  train validate --config my_run.yaml --explain     (check it; where each value came from)

  train runs     (every run: status, steps, losses)
"""

COMMANDS_HELP = (
    "Commands (train COMMAND --help):\n\n"
    + "\n\n".join(f"  {name:<9} {line}" for name, (_, line) in COMMANDS.items())
    + "\n\nShell completion: train --install-completion (or --show-completion to see it)."
)

# The group's own options, which stay with it rather than go to the run command.
_GROUP_OPTIONS = ("--install-completion", "--show-completion")
# The run command's internal name: `train ARGS` is parsed as `train run ARGS`.
_RUN = "run"


class _DefaultToRun(TyperGroup):
    """`train --config x` runs the command named `run`, which is the default, and `train
    --help` is its help. The name is internal: typed, `train run` is refused, one letter
    away from `train runs`."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        if args and args[0] == _RUN and not ctx.resilient_parsing:
            err.print(
                Text("error: ", style="bold red")
                + Text(
                    "no command 'run': `train --config FILE` runs a spec; "
                    "`train runs` lists the runs"
                )
            )
            raise typer.Exit(2)
        own = (
            args[0] in self.commands or args[0] in _GROUP_OPTIONS if args else ctx.resilient_parsing
        )
        if not own and args and not args[0].startswith("-") and "=" not in args[0]:
            # `train valdate ...` is a typo of a command, not an override the run would refuse.
            shown = [name for name, command in self.commands.items() if not command.hidden]
            close = difflib.get_close_matches(args[0], shown, n=1)
            if close:
                ctx.fail(f"no command {args[0]!r}; did you mean `train {close[0]}`?")
        return super().parse_args(ctx, args if own else [_RUN, *args])

    def shell_complete(self, ctx: typer.Context, incomplete: str) -> list[Any]:
        # `train <TAB>`: the commands, and the run's own options.
        run = self.commands[_RUN]
        with run.make_context(_RUN, [], parent=ctx, resilient_parsing=True) as sub:
            return [*super().shell_complete(ctx, incomplete), *run.shell_complete(sub, incomplete)]


class _RunContext(typer.Context):
    @property
    def command_path(self) -> str:
        # The run command is `train`, not `train run`: in its usage line and its errors.
        return self.parent.command_path if self.parent else super().command_path


class _RunCommand(TyperCommand):
    context_class = _RunContext


app = typer.Typer(
    cls=_DefaultToRun,
    add_completion=True,
    no_args_is_help=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)


app.command(
    _RUN,
    cls=_RunCommand,
    hidden=True,
    epilog=EXAMPLES + "\n" + COMMANDS_HELP,
    context_settings={"allow_interspersed_args": True},
)(run_command)
for _name, (_command, _line) in COMMANDS.items():
    app.command(_name, short_help=_line)(_command)


def main() -> None:
    try:
        app(prog_name="train")
    finally:
        # `train ... | head`: what the reader never took must not fail the exit (code 120).
        flush_standard_streams()


if __name__ == "__main__":
    sys.exit(main())

"""`train export`: write a checkpoint's model as one file plain PyTorch loads, or as a Hugging
Face folder (`--hf`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from launcher.cli.options import DebugOpt, run_guarded
from launcher.errors import UsageError

if TYPE_CHECKING:
    from torch import nn

_WHICH = "give --out FILE (a state_dict) or --hf DIR (a Hugging Face folder)"
_NEEDS_RECIPE = (
    "--ema and --hf build the run's model from its recipe, as the checkpoint records it "
    "(recipe.source, recipe.model), to learn which weights are tied; restore the recipe, or "
    "export the trained weights with --out alone."
)


def export_command(
    source: Annotated[
        str,
        typer.Argument(
            metavar="SOURCE",
            help="A checkpoint folder, or a run folder (its newest complete checkpoint); or "
            "a checkpoint's URL in a store (s3://bucket/prefix/step-00000100).",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="The file to write: .safetensors, or .pt/.pth/.bin (torch.save). An existing "
            "file is never overwritten.",
            show_default=False,
        ),
    ] = None,
    hf: Annotated[
        Path | None,
        typer.Option(
            "--hf",
            metavar="DIR",
            help="Write a folder that a Hugging Face model's from_pretrained(DIR) loads "
            "(config.json, sharded safetensors), for a recipe whose model is a transformers "
            "PreTrainedModel. A folder that holds anything is never written into.",
            show_default=False,
        ),
    ] = None,
    max_shard_size: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="With --hf: the largest weights file; bigger models are split into several "
            "(5GB, 500MB, 2GiB). Default: 5GB.",
            show_default=False,
        ),
    ] = None,
    best: Annotated[
        bool,
        typer.Option(
            "--best", help="Export the run's best checkpoint by checkpoint.monitor instead."
        ),
    ] = False,
    ema: Annotated[
        bool,
        typer.Option(
            "--ema",
            help="Export the weights' average (train.ema) instead of the trained weights.",
        ),
    ] = False,
    debug: DebugOpt = False,
) -> None:
    """Write a checkpoint's model as one file that plain PyTorch loads: the whole, unsharded
    state_dict, for any strategy and number of processes; or, with --hf, as a folder that
    from_pretrained loads. Starts no processes."""

    def write() -> int:
        if (out is None) == (hf is None):  # before torch is imported: said at once
            raise UsageError(f"train export: {_WHICH}, one of the two")
        if max_shard_size is not None and hf is None:
            raise UsageError("--max-shard-size: applies to --hf only")
        from launcher.checkpoint.export import export
        from launcher.checkpoint.hf_export import DEFAULT_SHARD_SIZE, export_hf
        from launcher.safe_text import clean
        from launcher.storage_url import location

        place = location(source, what="train export")

        if hf is not None:
            size = max_shard_size or DEFAULT_SHARD_SIZE
            exported = export_hf(
                place, hf, best=best, ema=ema, recipe_model=recipe_model, max_shard_size=size
            )
        else:
            assert out is not None
            exported = export(place, out, best=best, ema=ema, recipe_model=recipe_model)
        # Clean: it names the checkpoint's entries and its monitor, as its files spell them.
        typer.echo(clean(exported.describe()))
        return 0

    run_guarded(write, debug)


def recipe_model(checkpoint: Path) -> nn.Module:
    """The model the checkpoint's run trained, as its recipe builds it from the spec the
    checkpoint records: on the meta device (no memory, no init), or, where its constructor
    cannot run there, on the CPU, as ddp builds it."""
    from pydantic import ValidationError

    from launcher.checkpoint.format import recorded_spec
    from launcher.config.spec import RecipeSection
    from launcher.parallel.sharded_init import MetaBuildFailed, build_on_meta
    from launcher.rundir.layout import CheckpointFiles
    from launcher.worker.recipe import load_recipe

    meta = CheckpointFiles(checkpoint).meta
    try:
        spec, _ = recorded_spec(checkpoint)
        section = RecipeSection.model_validate(spec.get("recipe"))
        recipe = load_recipe(section.source)
        try:
            return build_on_meta(lambda: recipe.build_model(**section.model))
        except MetaBuildFailed:
            return recipe.build_model(**section.model)
    except ValidationError:
        raise UsageError(f"{meta}: its record of the recipe cannot be read") from None
    except UsageError as exc:
        raise UsageError(exc.message, details=exc.details, hint=_NEEDS_RECIPE) from None

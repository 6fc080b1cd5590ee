"""`train export --hf DIR`: a checkpoint's model as a Hugging Face folder that
`from_pretrained(DIR)` loads, for a recipe whose model is a `transformers.PreTrainedModel`.

The recipe's model, built on the meta device from the spec the checkpoint records, writes the
folder itself (`save_pretrained`, given the checkpoint's tensors as its state dict): its own
`config.json` and `generation_config.json`, safetensors files split above `--max-shard-size`
with their index, and each tied weight once, under the name `from_pretrained` ties the others
to. The folder is written beside DIR under a hidden name, then renamed: DIR appears whole or
not at all, and a folder that holds anything is never written into. DIR's missing parent
folders are created, as `save_pretrained` creates them.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from launcher.checkpoint.export import Exported, readable_like_any_file
from launcher.checkpoint.whole_model import RecipeModel, read_model
from launcher.errors import UsageError
from launcher.parallel.hugging_face import is_hf_model
from launcher.rundir.atomic import write_new_folder

DEFAULT_SHARD_SIZE = "5GB"  # the Hub's usual shard size (transformers 5's own default: 50GB)
_NEVER_OVERWRITTEN = "Choose another --hf folder, or empty this one first."


def export_hf(
    source: Path,
    out: Path,
    *,
    recipe_model: RecipeModel,
    best: bool = False,
    ema: bool = False,
    max_shard_size: str = DEFAULT_SHARD_SIZE,
) -> Exported:
    """Writes the model of the checkpoint `source` names to the new folder `out`, as
    `save_pretrained` writes it; with `ema`, the weights' average (`train.ema`)."""
    check_hf_out(out)  # before reading anything: a wrong --hf costs nothing
    shard_bytes = _shard_bytes(max_shard_size)
    read = read_model(
        source,
        best=best,
        ema=ema,
        recipe_model=lambda checkpoint: _hf_model(recipe_model(checkpoint)),
    )
    model = read.model
    assert model is not None  # read_model keeps the model it was given
    _check_fits(model, read.tensors, read.checkpoint)

    def save(folder: Path) -> None:
        from transformers.utils import logging

        logging.disable_progress_bar()  # one bar per shard file, on the user's terminal
        # A copy: save_pretrained empties the dict it is given, and drops tied names from it.
        state = dict(read.tensors)
        model.save_pretrained(folder, state_dict=state, max_shard_size=shard_bytes)
        for file in folder.iterdir():
            readable_like_any_file(file)

    _make_parents(out)
    if not write_new_folder(out, save):
        raise UsageError(
            f"--hf {out}: written to meanwhile; it is never overwritten", hint=_NEVER_OVERWRITTEN
        )
    return Exported.of(read, out)


def check_hf_out(out: Path) -> None:
    """Refuses an `--hf` folder that holds anything (it is never written into), a file, or
    one whose missing parents cannot be created because a file stands in their place."""
    if out.is_dir() and any(out.iterdir()):
        raise UsageError(
            f"--hf {out}: this folder is not empty; it is never overwritten",
            hint=_NEVER_OVERWRITTEN,
        )
    if out.exists() and not out.is_dir():
        raise UsageError(f"--hf {out}: a file is there; --hf names a folder to create")
    existing = next(folder for folder in out.absolute().parents if folder.exists())
    if not existing.is_dir():
        raise UsageError(f"--hf {out}: {existing} is a file, where a folder would be created")


def _make_parents(out: Path) -> None:
    """Creates `out`'s missing parents, once the export is known to be writable: a refused
    export leaves no empty folders behind."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--hf {out}: cannot create {out.parent}: {exc.strerror}") from None


def _shard_bytes(max_shard_size: str) -> int:
    """`--max-shard-size` (`5GB`, `500MB`, `2GiB`) in bytes, as transformers reads it."""
    try:
        from transformers.utils.hub import convert_file_size_to_int
    except ImportError:
        raise UsageError(
            "--hf: transformers is not installed here, so no recipe's model is a Hugging Face "
            "model; export its state_dict with --out FILE"
        ) from None
    try:
        size = convert_file_size_to_int(max_shard_size.strip())
    except ValueError:
        size = 0
    if size <= 0:
        raise UsageError(
            f"--max-shard-size {max_shard_size}: expected a size such as 5GB, 500MB or 2GiB"
        )
    return size


def _hf_model(model: nn.Module) -> nn.Module:
    if not is_hf_model(model):
        raise UsageError(
            f"--hf: the recipe's model is a {type(model).__name__}, not a Hugging Face "
            "transformers model (PreTrainedModel); export its state_dict with --out FILE"
        )
    return model


def _check_fits(model: nn.Module, tensors: dict[str, torch.Tensor], checkpoint: Path) -> None:
    """The checkpoint's names and shapes must be the model's: `config.json` comes from the
    model the recipe builds now, the weights from the run."""
    with warnings.catch_warnings():
        # The model is on the meta device: copying into it is a no-op, which is the point.
        warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter")
        try:
            model.load_state_dict(tensors, strict=True)
        except RuntimeError as exc:
            raise UsageError(
                f"--hf: the model in {checkpoint} does not fit the model its recipe builds:",
                details=[line.strip() for line in str(exc).splitlines()[1:] if line.strip()],
                hint="The recipe or recipe.model changed since the run: restore them, or "
                "export the state_dict with --out FILE.",
            ) from None

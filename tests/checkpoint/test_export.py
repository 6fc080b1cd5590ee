"""`train export`: a checkpoint of any strategy and world size becomes one file that plain
PyTorch loads strictly into the recipe's own model, with the weights the run saved. Runs are
real (`train` as a subprocess), `train export` runs in a fork of this process
(tests/forked_train.py); the exported weights are checked against the checkpoint read by another
route (DCP in this process), not against export's own reader."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from launcher.checkpoint.export import export, write_state_dict
from launcher.checkpoint.whole_model import resolve_source
from launcher.errors import UsageError
from launcher.rundir.layout import CheckpointFiles, RunLayout
from recipes.mlp import build_model
from tests.conftest import (
    FAULTY_RECIPE,
    REPO,
    finish_train,
    run_train,
    usage_error,
    wait_for_step,
    write_spec,
)
from tests.forked_train import fork_train, train_in_fork

pytestmark = [
    pytest.mark.timeout(180),
    # DCP in this process, on purpose: the reference route and the fake checkpoints.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:TypedStorage is deprecated"),  # torch 2.9 DCP saves
]

HAS_XLA = importlib.util.find_spec("torch_xla") is not None
HAS_SAFETENSORS = importlib.util.find_spec("safetensors") is not None
needs_safetensors = pytest.mark.skipif(not HAS_SAFETENSORS, reason="no safetensors here")

# The gpt recipe with its lm_head tied to the token embedding, as GPT-2 ties them.
TIED_GPT = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from recipes.gpt import build_dataset, loss
from recipes.gpt import build_model as gpt


def build_model(n_layer=1, n_head=2, n_embd=16, block_size=16, dropout=0.0):
    model = gpt(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
                dropout=dropout)
    model.lm_head.weight = model.tok_emb.weight
    return model
"""


def _load(path: Path) -> dict[str, torch.Tensor]:
    """The exported file, as a user loads it."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path)


def _from_checkpoint(model: torch.nn.Module, checkpoint: Path, prefix: str = "") -> None:
    """Fills `model` from a checkpoint the way a resume does (DCP, in place), in this one
    process: the independent route the exported file is compared with."""
    state = {"model": {prefix + k: v for k, v in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)


def _assert_same_model(a: torch.nn.Module, b: torch.nn.Module, inputs: torch.Tensor) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    with torch.no_grad():
        torch.testing.assert_close(a(inputs), b(inputs), rtol=0, atol=0)


def _export(source: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return train_in_fork(["export", str(source), "--out", str(out), *args], cwd=out.parent)


def _train(folder: Path, env: dict[str, str] | None = None, **sections: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    spec = write_spec(folder / "run.yaml", **sections)
    args = ["--config", str(spec), "--run-dir", str(folder / "run")]
    result = run_train(args, cwd=folder, timeout=240, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return folder / "run"


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mlp on 2 CPU processes with FSDP2 (each rank saves its own shards); checkpoints at
    steps 3 and 6."""
    return _train(
        tmp_path_factory.mktemp("fsdp"),
        launch={"accelerator": "cpu", "devices": 2, "strategy": "fsdp"},
        optim={"name": "AdamW", "lr": 0.01},
        train={"max_steps": 6, "log_every": 3},
        checkpoint={"every_n_steps": 3},
    )


@pytest.mark.launcher_only
@pytest.mark.parametrize("suffix", [pytest.param(".safetensors", marks=needs_safetensors), ".pt"])
def test_an_fsdp_run_exports_the_weights_it_saved(
    fsdp_run: Path, tmp_path: Path, suffix: str
) -> None:
    out = tmp_path / f"model{suffix}"
    result = _export(fsdp_run, out)
    assert result.returncode == 0, result.stdout + result.stderr
    newest = RunLayout(fsdp_run).checkpoint(6)
    assert "exported 6 tensors (5,313 values, " in result.stdout
    assert f"from {newest} to {out}" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no temporary file left

    exported = build_model()
    exported.load_state_dict(_load(out), strict=True)
    reference = build_model()
    _from_checkpoint(reference, newest)
    _assert_same_model(exported, reference, torch.randn(32, 16))


@pytest.mark.launcher_only
def test_a_checkpoint_folder_exports_itself_and_a_run_folder_its_newest(
    fsdp_run: Path, tmp_path: Path
) -> None:
    older = RunLayout(fsdp_run).checkpoint(3)
    assert resolve_source(fsdp_run) == (RunLayout(fsdp_run).checkpoint(6), None)
    assert resolve_source(older) == (older, None)
    result = export(older, tmp_path / "old.pt")  # in this process: no process group
    assert not dist.is_initialized()
    assert result.checkpoint == older and result.tensors == 6 and result.best is None
    exported, reference = build_model(), build_model()
    exported.load_state_dict(torch.load(tmp_path / "old.pt"), strict=True)
    _from_checkpoint(reference, older)
    _assert_same_model(exported, reference, torch.randn(8, 16))


@pytest.mark.launcher_only
def test_best_exports_the_best_checkpoint_of_the_run(fsdp_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(fsdp_run, run)
    # The record of scores the newest checkpoint keeps for checkpoint.monitor.
    meta = CheckpointFiles(RunLayout(run).checkpoint(6)).meta
    record = json.loads(meta.read_text())
    record["best"] = {"monitor": "val_loss", "kept": [[3, 0.25]]}
    meta.write_text(json.dumps(record))
    best = RunLayout(run).checkpoint(3)
    result = _export(run, tmp_path / "best.pt", "--best")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"from {best} to" in result.stdout
    assert f"best checkpoint: {best} (val_loss 0.25 at step 3)" in result.stdout
    # A checkpoint folder with --best: the best of the run it belongs to.
    assert export(RunLayout(run).checkpoint(6), tmp_path / "b.pt", best=True).checkpoint == best


@pytest.mark.launcher_only
def test_best_without_a_monitored_run_is_refused(fsdp_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "best.pt"
    usage_error(_export(fsdp_run, out, "--best"), "has no best checkpoint", "checkpoint.monitor")
    assert not out.exists()


@pytest.mark.launcher_only
@needs_safetensors
def test_tied_weights_export_and_load_strictly(tmp_path: Path) -> None:
    (tmp_path / "tied_gpt.py").write_text(TIED_GPT)
    run = _train(
        tmp_path / "gpt",
        launch={"accelerator": "cpu", "devices": 2, "strategy": "fsdp"},
        recipe={
            "source": str(tmp_path / "tied_gpt.py"),
            "dataset": {"block_size": 16, "max_bytes": 4000},
        },
        data={"batch_size": 4},
        optim={"name": "AdamW", "lr": 3e-3},
        train={"max_steps": 3, "log_every": 3},
    )
    out = tmp_path / "gpt.safetensors"
    result = _export(run, out)
    assert result.returncode == 0, result.stdout + result.stderr
    sys.path.insert(0, str(tmp_path))
    try:
        from tied_gpt import build_model as tied_gpt
    finally:
        sys.path.remove(str(tmp_path))
    exported, reference = tied_gpt(), tied_gpt()
    state = _load(out)
    assert {"tok_emb.weight", "lm_head.weight"} <= state.keys()
    exported.load_state_dict(state, strict=True)
    assert exported.lm_head.weight is exported.tok_emb.weight  # still tied after loading
    _from_checkpoint(reference, RunLayout(run).checkpoint(3))
    _assert_same_model(exported, reference, torch.randint(0, 256, (2, 16)))


# No run needed: bad input is refused before a checkpoint is read.


def _fake_checkpoint(folder: Path, model_state: dict) -> Path:
    """A checkpoint folder as the launcher publishes one, from this process."""
    dcp.save({"model": model_state}, checkpoint_id=folder, no_dist=True)
    CheckpointFiles(folder).marker.write_text("")
    return folder


def test_an_existing_out_is_never_overwritten(tmp_path: Path) -> None:
    checkpoint = _fake_checkpoint(tmp_path / "ckpt", {"w": torch.ones(3)})
    out = tmp_path / "model.pt"
    out.write_text("mine")
    usage_error(_export(checkpoint, out), f"--out {out}: already exists", "never overwritten")
    assert out.read_text() == "mine"


@pytest.mark.parametrize("suffix", [".pt", pytest.param(".safetensors", marks=needs_safetensors)])
def test_a_file_created_while_writing_is_never_replaced(tmp_path: Path, suffix: str) -> None:
    """`--out` was free when checked, then someone wrote it before the export was done."""
    out = tmp_path / f"model{suffix}"
    out.write_text("theirs")
    with pytest.raises(UsageError, match="already exists"):
        write_state_dict({"w": torch.ones(3)}, out)
    assert out.read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no temporary file left


def test_an_unknown_suffix_names_out_and_the_accepted_ones(tmp_path: Path) -> None:
    checkpoint = _fake_checkpoint(tmp_path / "ckpt", {"w": torch.ones(3)})
    out = tmp_path / "model.txt"
    usage_error(_export(checkpoint, out), f"--out {out}", ".safetensors, .pt, .pth, .bin")
    for name in ("model", "model.safetensors.tmp"):
        with pytest.raises(UsageError, match=r"--out .* expected a file name ending in"):
            export(checkpoint, tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_folder_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    usage_error(_export(tmp_path, tmp_path / "m.pt"), "neither a checkpoint nor a run folder")
    with pytest.raises(UsageError, match="no such folder"):
        resolve_source(tmp_path / "nope")


def test_a_truncated_shard_is_a_short_error(tmp_path: Path) -> None:
    checkpoint = _fake_checkpoint(tmp_path / "ckpt", {"w": torch.ones(1000)})
    (shard,) = [p for p in checkpoint.iterdir() if p.suffix == ".distcp"]
    shard.write_bytes(shard.read_bytes()[:100])
    out = tmp_path / "m.pt"
    # Found short before it is read: its .metadata claims more than the files hold.
    usage_error(_export(checkpoint, out), "more than its files hold", "it is damaged")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing half-written


def test_a_metadata_claiming_more_than_its_files_hold_is_refused(tmp_path: Path) -> None:
    """A .metadata that says a tensor has 2**40 elements: refused, nothing allocated."""
    checkpoint = _fake_checkpoint(tmp_path / "ckpt", {"w": torch.ones(1000)})
    path = checkpoint / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    metadata.state_dict_metadata["model.w"].size = torch.Size([2**40])
    path.write_bytes(pickle.dumps(metadata))
    result = _export(checkpoint, tmp_path / "m.pt")
    usage_error(result, "its .metadata claims 4398.0 GB of model tensors", "it is damaged")


def test_non_tensor_model_entries_are_skipped_and_named(tmp_path: Path) -> None:
    checkpoint = _fake_checkpoint(
        tmp_path / "ckpt", {"w": torch.arange(4.0), "norm._extra_state": 2}
    )
    result = export(checkpoint, tmp_path / "m.pt")
    assert result.skipped == ["norm._extra_state"]
    assert "skipped 1 non-tensor model entries: norm._extra_state" in result.describe()
    assert torch.equal(torch.load(tmp_path / "m.pt")["w"], torch.arange(4.0))


@needs_safetensors
def test_shared_and_strided_tensors_are_written_to_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    base = torch.arange(12.0).reshape(3, 4)
    state = {"a": base, "tied": base, "t": base.t(), "row": base[1]}
    write_state_dict(state, tmp_path / "m.safetensors")
    loaded = load_file(tmp_path / "m.safetensors")
    assert loaded.keys() == state.keys()
    for key in state:
        assert torch.equal(loaded[key], state[key]), key
    assert (tmp_path / "m.safetensors").stat().st_mode & 0o044  # readable like any file


def test_without_safetensors_the_error_says_what_to_do(tmp_path: Path) -> None:
    checkpoint = _fake_checkpoint(tmp_path / "ckpt", {"w": torch.ones(3)})
    blocker = tmp_path / "no_safetensors"
    blocker.mkdir()
    (blocker / "safetensors.py").write_text("raise ImportError('no safetensors')\n")
    paths = [str(blocker), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"PYTHONPATH": os.pathsep.join(paths)}
    result = run_train(
        ["export", str(checkpoint), "--out", str(tmp_path / "m.safetensors")], tmp_path, env=env
    )
    usage_error(result, "pip install safetensors", ".pt")


@pytest.mark.xla
@pytest.mark.skipif(not HAS_XLA, reason="torch_xla is not installed here")
@pytest.mark.timeout(300)
def test_an_xla_fsdp_checkpoint_exports_to_the_bare_model(tmp_path: Path) -> None:
    """FSDPv2 saves its wrapper's keys (`_orig_module.0.weight`); export writes the bare
    model's, from 4 XLA devices' shards."""
    run = _train(
        tmp_path,
        env={"PJRT_DEVICE": "CPU"},
        launch={"accelerator": "tpu", "devices": 4, "strategy": "xla_fsdp"},
        optim={"name": "AdamW", "lr": 0.01},
        train={"max_steps": 3, "log_every": 3},
    )
    out = tmp_path / "model.pt"
    result = _export(run, out)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "_orig_module" not in str(torch.load(out).keys())
    exported, reference = build_model(), build_model()
    exported.load_state_dict(torch.load(out), strict=True)
    _from_checkpoint(reference, RunLayout(run).checkpoint(3), prefix="_orig_module.")
    _assert_same_model(exported, reference, torch.randn(32, 16))


@pytest.mark.timeout(300)
def test_a_running_run_that_keeps_one_checkpoint_exports(tmp_path: Path) -> None:
    """Saves every 2 steps, keeps 1: the newest checkpoint is often removed while it is read;
    export then reads the one that replaced it."""
    (tmp_path / "faulty.py").write_text(FAULTY_RECIPE)
    spec = write_spec(
        tmp_path / "run.yaml",
        recipe={"source": "faulty.py", "dataset": {}},
        train={"max_steps": 10_000, "log_every": 50},
        checkpoint={"every_n_steps": 2, "keep_last": 1},
    )
    proc = fork_train(["--config", str(spec), "--run-dir", str(tmp_path / "run")], tmp_path,
                       env={"FAULT": "slow", "FAULT_RANK": "0"})  # fmt: skip
    try:
        wait_for_step(tmp_path / "run", 0, 4, proc)
        exports = tmp_path / "exports"  # its own folder: the check for leftovers looks there
        exports.mkdir()
        for i in range(4):
            result = _export(tmp_path / "run", exports / f"m{i}.pt")
            assert result.returncode == 0, result.stdout + result.stderr
    finally:
        os.kill(proc.pid, signal.SIGINT)
        finish_train(proc, tmp_path)

"""`load.weights` / `--load-weights`: a new run starts from another run's weights only.

Runs are real (`train` as a subprocess, 2 processes, gloo). A fine-tuning run here trains one
step at `optim.lr: 0` and evaluates after it: its weights are still exactly the loaded ones, so
its first evaluation must equal the source run's last one. Exactly, for ddp and fsdp on CPU:
the weights are the same bits, every rank evaluates the same batches with the same kernels, and
fsdp's all-gather copies bits. Under XLA SPMD (one process evaluates the global batch at once)
the sums are added in another order: there, to float tolerance.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from launcher.checkpoint.catalog import latest_complete
from launcher.checkpoint.weights import match_names
from launcher.checkpoint.whole_model import load_model_state
from launcher.parallel.rng import seed_everything
from launcher.rundir.layout import RunLayout
from recipes.mlp import build_model
from tests.conftest import metrics_of, run_train, usage_error, write_spec
from tests.forked_train import train_in_fork

pytestmark = [
    pytest.mark.timeout(240),
    # DCP in this process (reading a run's checkpoint to compare), on purpose.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

HAS_SAFETENSORS = importlib.util.find_spec("safetensors") is not None
needs_safetensors = pytest.mark.skipif(not HAS_SAFETENSORS, reason="no safetensors here")
HAS_XLA = importlib.util.find_spec("torch_xla") is not None
# One step that changes nothing, then an evaluation of the weights as loaded.
FINE_TUNE = {
    "optim": {"name": "SGD", "lr": 0.0},
    "train": {"max_steps": 1, "log_every": 1},
    "eval": {"every_n_steps": 1},
}


def _evaluations(run: Path) -> list[dict]:
    return [r for r in metrics_of(run) if "val/loss" in r]


def _fine_tune(
    folder: Path,
    *args: str,
    strategy: str = "ddp",
    env: dict | None = None,
    refused: bool = False,
    **sections: dict,
) -> tuple:
    """A new run of the mlp recipe in `folder` (its own runs/), started with `args`; returns
    the result and the run folder (None where it made none). `refused`: the run is refused
    before any worker starts, so `train` runs in a fork of this process (tests/forked_train.py)."""
    folder.mkdir(parents=True, exist_ok=True)
    launch = {"accelerator": "cpu", "devices": 2, "strategy": strategy}
    spec = write_spec(folder / "ft.yaml", **{**FINE_TUNE, "launch": launch, **sections})
    run = train_in_fork if refused else run_train
    result = run(["--config", str(spec), *args], cwd=folder, env=env)
    runs = folder / "runs"
    made = [p for p in runs.glob("*/*") if p.is_dir()] if runs.is_dir() else []
    return result, made[0] if made else None


def _assert_same_evaluation(run: Path, source: Path, exact: bool = True) -> None:
    first, last = _evaluations(run)[0], _evaluations(source)[-1]
    assert first["step"] == 1  # a new run: step 0 was the loaded weights
    for key in ("val/loss", "val/mae"):
        if exact:
            assert first[key] == last[key], key
        else:
            assert first[key] == pytest.approx(last[key], rel=1e-6), key


@pytest.fixture(scope="module")
def source_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The mlp trained 6 steps by ddp on 2 processes, evaluated at its end, checkpointed."""
    folder = tmp_path_factory.mktemp("source")
    spec = write_spec(
        folder / "src.yaml",
        optim={"name": "AdamW", "lr": 0.01},
        train={"max_steps": 6, "log_every": 3},
        eval={"every_n_steps": 3},
    )
    result = run_train(["--config", str(spec), "--run-dir", str(folder / "run")], cwd=folder)
    assert result.returncode == 0, result.stdout + result.stderr
    return folder / "run"


@pytest.mark.smoke
def test_a_ddp_checkpoint_starts_an_fsdp_run_that_evaluates_as_the_source_ended(
    source_run: Path, tmp_path: Path
) -> None:
    # The run folder: its newest complete checkpoint, resolved by the launcher.
    result, run = _fine_tune(tmp_path, "--load-weights", str(source_run), strategy="fsdp")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    checkpoint = RunLayout(source_run).checkpoint(6)
    assert f"starting t from the weights of {checkpoint}: 2 x cpu, strategy fsdp" in output
    assert f"load.weights: loaded 6 tensors (5,313 values) from {checkpoint}" in output
    _assert_same_evaluation(run, source_run)
    # What it loaded is recorded: spec.yaml names the checkpoint, and where it came from.
    assert f"weights: {checkpoint}  # resolved at launch" in (run / "spec.yaml").read_text()


@needs_safetensors
def test_an_export_and_a_hugging_face_folder_start_ddp_runs(
    source_run: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    exported = tmp_path / "model.safetensors"
    result = train_in_fork(["export", str(source_run), "--out", str(exported)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # Given on the command line: relative to the working directory.
    result, run = _fine_tune(tmp_path / "export", "--load-weights", "../model.safetensors")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"loaded 6 tensors (5,313 values) from {exported}" in result.stdout
    _assert_same_evaluation(run, source_run)

    # A Hugging Face folder: shards and their index, as save_pretrained writes them.
    hf = tmp_path / "hf"
    hf.mkdir()
    state = load_file(exported)
    first = ["0.weight", "0.bias"]
    shards = {"model-00001-of-00002.safetensors": first}
    shards["model-00002-of-00002.safetensors"] = sorted(state.keys() - set(first))
    for name, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(hf / name))
    weight_map = {key: name for name, keys in shards.items() for key in keys}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    # In the YAML: relative to the YAML file, whatever the working directory.
    (tmp_path / "yaml").mkdir()
    result, run = _fine_tune(tmp_path / "yaml", load={"weights": "../hf"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"loaded 6 tensors (5,313 values) from {hf} (2 shards)" in result.stdout
    _assert_same_evaluation(run, source_run)


def test_mismatched_names_are_refused_and_strict_false_loads_the_rest(tmp_path: Path) -> None:
    # Saved from a DDP-wrapped model (`module.`): wrappers are not part of a name.
    torch.manual_seed(1)
    saved = build_model().state_dict()
    saved["0.weight"] = torch.zeros(64, 15)  # the model's is [64, 16]
    del saved["2.bias"]
    saved["head.weight"] = torch.ones(3)
    weights = tmp_path / "weights.pt"
    torch.save({f"module.{k}": v for k, v in saved.items()}, weights)

    result, _ = _fine_tune(tmp_path / "strict", "--load-weights", str(weights), refused=True)
    usage_error(
        result,
        f"load.weights {weights}: these weights do not fit the model (3 mismatched names):",
        "  shape of 0.weight: weights [64, 15], run [64, 16]",
        "  missing from the weights: 2.bias",
        "  not in the run: head.weight",
        "load.strict: false",
    )
    result, run = _fine_tune(
        tmp_path / "lenient", "--load-weights", str(weights), "load.strict=false", strategy="fsdp"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "load.weights: loaded 4 tensors (4,225 values)" in result.stdout
    assert "3 names did not fit; the model keeps the recipe's initialisation" in result.stdout
    assert "  not in the run: head.weight" in result.stdout
    # lr 0: the run's checkpoint holds the weights it started with. What fits is the file's;
    # the rest is the recipe's own initialisation (the seeded constructors, run.seed 0).
    trained, _ = load_model_state(latest_complete(run))
    seed_everything(0)
    initial = build_model().state_dict()
    for key in ("0.bias", "2.weight", "4.weight", "4.bias"):
        assert torch.equal(trained[key], saved[key]), key
    for key in ("0.weight", "2.bias"):
        assert torch.equal(trained[key], initial[key]), key


def test_a_run_started_from_weights_resumes_from_its_own_checkpoint(tmp_path: Path) -> None:
    weights = tmp_path / "weights.pt"
    torch.save(build_model().state_dict(), weights)
    result, run = _fine_tune(tmp_path, "--load-weights", str(weights))
    assert result.returncode == 0, result.stdout + result.stderr
    weights.unlink()  # a resume never reads them again
    spec = tmp_path / "ft.yaml"
    resumed = run_train(
        ["--config", str(spec), "--resume", str(run), "train.max_steps=2"], tmp_path
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "load.weights" not in resumed.stdout
    assert f"resuming t from {RunLayout(run).checkpoint(1)}" in resumed.stdout
    assert [r["step"] for r in _evaluations(run)] == [1, 2]

    # Weights given with --resume: the two ask for different runs.
    for given in (["--load-weights", str(run)], [f"load.weights={run}"]):
        again = train_in_fork(["--resume", str(run), "train.max_steps=3", *given], tmp_path)
        usage_error(again, "starts a new run from weights, and --resume", "give one of them")
    assert latest_complete(run) == RunLayout(run).checkpoint(2)


@pytest.mark.launcher_only
def test_weights_that_cannot_load_are_refused_before_anything_starts(tmp_path: Path) -> None:
    truncated = tmp_path / "cut.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    truncated.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    incomplete = tmp_path / "ckpt"
    incomplete.mkdir()
    (incomplete / "notes.txt").write_text("")
    cases = {
        str(tmp_path / "nowhere.pt"): "no such file or folder",
        str(incomplete / "notes.txt"): "not a file of known weights",
        str(truncated): "truncated: its header places 16 bytes of tensors, it holds 8",
        str(incomplete): "neither a checkpoint nor a run folder with a complete checkpoint",
    }
    for path, expected in cases.items():
        result, run = _fine_tune(tmp_path / "try", "--load-weights", path, refused=True)
        usage_error(result, f"load.weights {path}: {expected}")
        assert run is None  # no run folder, no worker


@pytest.mark.launcher_only
def test_names_match_without_wrappers_and_tied_weights_need_one_name() -> None:
    theirs = {"module.tok.weight": (8, 4), "module._orig_mod.h.weight": (4, 4), "x": (1,)}
    ours = {"tok.weight": (8, 4), "h.weight": (4, 4), "head.weight": (8, 4)}
    tied = {
        "tok.weight": {"tok.weight", "head.weight"},
        "head.weight": {"tok.weight", "head.weight"},
    }
    match = match_names(theirs, ours, tied)
    assert match.pairs == {
        "module.tok.weight": "tok.weight",
        "module._orig_mod.h.weight": "h.weight",
    }
    assert match.values == 8 * 4 + 4 * 4
    assert match.problems == ["not in the run: x"]  # head.weight is tok.weight: loaded
    untied = match_names(theirs, ours, {}, noun="checkpoint")
    assert untied.problems == ["missing from the checkpoint: head.weight", "not in the run: x"]
    shapes = match_names({"h.weight": (4, 5)}, {"h.weight": (4, 4)})
    assert shapes.pairs == {} and shapes.problems == [
        "shape of h.weight: weights [4, 5], run [4, 4]"
    ]


@pytest.mark.xla
@pytest.mark.skipif(not HAS_XLA, reason="torch_xla is not installed here")
@pytest.mark.parametrize("strategy", ["xla_spmd", "xla_fsdp"])
def test_a_ddp_checkpoint_starts_an_xla_run(
    source_run: Path, tmp_path: Path, strategy: str
) -> None:
    launch = {"accelerator": "tpu", "devices": 2, "strategy": strategy}
    result, run = _fine_tune(
        tmp_path, "--load-weights", str(source_run), launch=launch, env={"PJRT_DEVICE": "CPU"}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "load.weights: loaded 6 tensors (5,313 values)" in result.stdout
    _assert_same_evaluation(run, source_run, exact=False)

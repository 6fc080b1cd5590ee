"""Exact resume: a run stopped at step k and resumed gives, bitwise on CPU, the same logged
losses and the same final weights as a run that never stopped. Also: a crash at any moment of
a save never breaks `--resume latest`, async checkpoints hold what sync ones hold, and a
different world size or model is handled."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import REPO, TRAIN, metrics_of, only_run_dir, run_train, tiny_gpt, write_spec

pytestmark = pytest.mark.timeout(300)
STEPS = 20  # 14 steps per epoch: the run crosses an epoch boundary


def _gpt_spec(folder: Path, **checkpoint) -> Path:
    """A tiny GPT with dropout (so RNG state matters), shuffled data, accumulation."""
    folder.mkdir(parents=True, exist_ok=True)
    return write_spec(
        folder / "run.yaml",
        recipe=tiny_gpt(max_bytes=4000),
        data={"batch_size": 4, "shuffle": True},
        optim={"name": "AdamW", "lr": 3e-3, "schedule": "cosine", "warmup_steps": 3},
        train={"max_steps": STEPS, "grad_accum_steps": 2, "log_every": 2},
        checkpoint={"every_n_steps": 1, **checkpoint},
    )


def _losses(run: Path) -> dict[int, list[float]]:
    """Every logged loss by step (a step logged by several attempts appears once per attempt)."""
    out: dict[int, list[float]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "step" in record:  # not the mark a resume leaves
            out.setdefault(record["step"], []).append(record["loss"])
    return out


def _weights(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(checkpoint, scratch)
    return torch.load(scratch, weights_only=True)["model"]


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run, with a checkpoint after every step."""
    folder = tmp_path_factory.mktemp("reference")
    result = run_train(["--config", str(_gpt_spec(folder))], cwd=folder)
    assert result.returncode == 0, result.stdout + result.stderr
    return only_run_dir(folder / "runs")


@pytest.mark.parametrize("k", [5, 14, 17], ids=["mid-epoch", "epoch-end", "next-epoch"])
def test_resume_at_step_k_is_bitwise_identical(tmp_path: Path, reference: Path, k: int) -> None:
    spec = _gpt_spec(tmp_path)
    start = reference / "checkpoints" / f"step-{k:08d}"
    result = run_train(
        ["--config", str(spec), "--resume", str(start), "--run-dir", str(tmp_path / "branch")],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resumed at step {k}" in result.stdout
    ours, theirs = _losses(tmp_path / "branch"), _losses(reference)
    assert sorted(ours) == [s for s in sorted(theirs) if s > k]
    for step, values in ours.items():
        assert values == theirs[step], f"step {step}: {values} != {theirs[step]}"
    final = f"checkpoints/step-{STEPS:08d}"
    _assert_bitwise(
        _weights(tmp_path / "branch" / final, tmp_path / "a.pt"),
        _weights(reference / final, tmp_path / "b.pt"),
    )


def test_a_different_run_really_differs(tmp_path: Path, reference: Path) -> None:
    """Guards the test above: another seed must change the numbers it compares."""
    spec = _gpt_spec(tmp_path)
    result = run_train(["--config", str(spec), "run.seed=1", "train.max_steps=4"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    ours = _losses(only_run_dir(tmp_path / "runs"))
    assert ours[2] != _losses(reference)[2]


def _kill_during_save(
    proc: subprocess.Popen, runs: Path, after_step: int, delay: float, whole_tree: bool
) -> int:
    """SIGKILLs the launcher (and its workers, with `whole_tree`) while a save of a step
    > after_step is open. Workers must die with their launcher either way."""
    deadline = time.time() + 120
    while time.time() < deadline:
        partial = [
            p
            for p in runs.glob("*/*/checkpoints/.step-*.partial")
            if int(p.name[6:14]) > after_step
        ]
        if partial:
            time.sleep(delay)
            tree = [proc, *psutil.Process(proc.pid).children(recursive=True)]
            for p in tree if whole_tree else tree[:1]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            psutil.wait_procs(
                [psutil.Process(p.pid) for p in tree[1:] if psutil.pid_exists(p.pid)], timeout=30
            )
            return int(partial[0].name[6:14])
        if proc.poll() is not None:
            pytest.fail(f"the run ended before a save after step {after_step} was caught")
        time.sleep(0.002)
    pytest.fail("no save was caught in time")


def test_sigkill_during_saves_never_breaks_resume_latest(tmp_path: Path, reference: Path) -> None:
    spec = _gpt_spec(tmp_path)
    runs = tmp_path / "runs"
    killed_at = 0
    for attempt, (delay, whole_tree) in enumerate([(0.0, False), (0.01, True), (0.03, True)]):
        resume = ["--resume", "latest"] if attempt else []
        proc = subprocess.Popen(
            [str(TRAIN), "--config", str(spec), *resume],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        killed_at = _kill_during_save(proc, runs, killed_at + 2, delay, whole_tree)
        run_dir = only_run_dir(runs)  # resumes continue in the same run folder
        complete = sorted((run_dir / "checkpoints").glob("step-*"))
        assert complete and all((c / "COMPLETE").is_file() for c in complete)
        alive = [
            p
            for p in psutil.process_iter(["cmdline"])
            if str(run_dir) in " ".join(p.info["cmdline"] or [])
        ]
        assert not alive, "workers outlived their killed launcher"
    result = run_train(["--config", str(spec), "--resume", "latest"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = only_run_dir(runs)
    ours, theirs = _losses(run_dir), _losses(reference)
    assert sorted(ours) == sorted(theirs)
    for step, values in ours.items():  # every attempt logged exactly the reference's numbers
        assert set(values) == set(theirs[step]), step
    final = f"checkpoints/step-{STEPS:08d}"
    _assert_bitwise(
        _weights(run_dir / final, tmp_path / "a.pt"), _weights(reference / final, tmp_path / "b.pt")
    )


@pytest.mark.smoke
def test_async_checkpoints_hold_exactly_what_sync_ones_hold(
    tmp_path: Path, reference: Path
) -> None:
    spec = _gpt_spec(tmp_path, **{"async": True})
    result = run_train(["--config", str(spec), "--run-dir", str(tmp_path / "async")], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _losses(tmp_path / "async") == _losses(reference)
    for step in (1, 7, STEPS):
        name = f"checkpoints/step-{step:08d}"
        assert (tmp_path / "async" / name / "COMPLETE").is_file()
        _assert_bitwise(
            _weights(tmp_path / "async" / name, tmp_path / f"a{step}.pt"),
            _weights(reference / name, tmp_path / f"b{step}.pt"),
        )


GPT_SMALL = {
    "source": str(REPO / "recipes" / "gpt.py"),
    "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
    "dataset": {"block_size": 16, "max_bytes": 20000},
}


def _saved_run(tmp_path: Path, **sections) -> tuple[Path, Path]:  # type: ignore[no-untyped-def]
    """A finished 2-process run in tmp_path/a; returns (its spec, its folder)."""
    spec = write_spec(tmp_path / "run.yaml", **sections)
    run = tmp_path / "a"
    result = run_train(["--config", str(spec), "--run-dir", str(run)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    return spec, run


@pytest.mark.parametrize(
    ("strategy", "devices", "batch"),
    [
        ("ddp", 1, 8),
        pytest.param("fsdp", 1, 8, marks=pytest.mark.smoke),  # DCP's resharding: torch's API
        ("ddp", 4, 2),
        ("fsdp", 4, 2),
    ],
)
def test_resume_with_another_world_size(
    tmp_path: Path, strategy: str, devices: int, batch: int
) -> None:
    """Saved on 2 processes, resumed on 1 or 4 with the same global batch: same training."""
    spec, ref = _saved_run(
        tmp_path,
        launch={"strategy": strategy},
        recipe=GPT_SMALL if strategy == "fsdp" else {},
        data={"batch_size": 4},
        train={"max_steps": 8, "log_every": 1},
        checkpoint={"every_n_steps": 4},
        optim={"name": "AdamW", "lr": 1e-2},
    )
    result = run_train(
        [
            "--config",
            str(spec),
            "--resume",
            str(ref / "checkpoints" / "step-00000004"),
            "--run-dir",
            str(tmp_path / "other"),
            "--devices",
            str(devices),
            f"data.batch_size={batch}",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "random streams are reseeded" in result.stdout
    ours, theirs = _losses(tmp_path / "other"), _losses(ref)
    assert sorted(ours) == [5, 6, 7, 8]
    for step in ours:
        torch.testing.assert_close(ours[step][0], theirs[step][0], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A finished run of the mlp, 2 steps: (its spec, its folder). Copy it to change it."""
    return _saved_run(tmp_path_factory.mktemp("two_steps"), train={"max_steps": 2})


def test_checkpoint_of_another_model_lists_the_mismatched_keys(
    tmp_path: Path, two_steps: tuple[Path, Path]
) -> None:
    spec, saved = two_steps
    result = run_train(
        [
            "--config",
            str(spec),
            "--resume",
            str(saved),
            "--run-dir",
            str(tmp_path / "b"),
            "recipe.model={hidden: 32, depth: 3}",
            "train.max_steps=4",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "this checkpoint does not fit the model and optimizer" in result.stdout
    assert "shape of model.0.weight: checkpoint [64, 16], run [32, 16]" in result.stdout
    assert "missing from the checkpoint: model.6.weight" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


class _Evil:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("touch pwned",))


@pytest.mark.parametrize(
    "content", [b"garbage", pickle.dumps(_Evil())], ids=["corrupt", "malicious"]
)
def test_corrupt_or_malicious_checkpoint_is_refused(
    tmp_path: Path, content: bytes, two_steps: tuple[Path, Path]
) -> None:
    spec, saved = two_steps
    shutil.copytree(saved, tmp_path / "a")
    (tmp_path / "a" / "checkpoints" / "step-00000002" / ".metadata").write_bytes(content)
    result = run_train(
        ["--config", str(spec), "--resume", str(tmp_path / "a"), "--run-dir", str(tmp_path / "b")],
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "corrupt or unsafe checkpoint metadata" in result.stdout + result.stderr
    assert not (tmp_path / "pwned").exists()


def test_recipe_state_hook_is_checkpointed(tmp_path: Path) -> None:
    (tmp_path / "counting.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO / 'recipes')!r})\n"
        "from mlp import build_dataset, build_model, loss as mse\n"
        "calls = 0\n"
        "def loss(model, batch):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    value, _ = mse(model, batch)\n"
        "    return value, {'calls': float(calls)}\n"
        "def state_dict():\n"
        "    return {'calls': calls}\n"
        "def load_state_dict(state):\n"
        "    global calls\n"
        "    calls = state['calls']\n"
    )
    spec = write_spec(
        tmp_path / "run.yaml", recipe={"source": "counting.py"}, checkpoint={"every_n_steps": 2}
    )
    first = run_train(["--config", str(spec), "train.max_steps=4"], cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    second = run_train(
        ["--config", str(spec), "--resume", "latest", "train.max_steps=6"], cwd=tmp_path
    )
    assert second.returncode == 0, second.stdout + second.stderr
    calls = [r["calls"] for r in metrics_of(only_run_dir(tmp_path / "runs"))]
    assert calls == [1, 2, 3, 4, 5, 6]  # the counter continued instead of restarting at 1

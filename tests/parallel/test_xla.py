"""The torch_xla strategies, run for real on XLA's CPU devices (PJRT_DEVICE=CPU).

They run in `.venv-xla` (torch 2.9 + torch_xla 2.9), where `make test-xla` sets
LAUNCHER_REQUIRE_XLA=1 so that a broken torch_xla fails these tests instead of skipping them.
Elsewhere (the torch 2.13 environment has no torch_xla) they are skipped, except the checks of
what happens without torch_xla. Every run has a hard timeout: a hung XLA collective fails fast.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from launcher.launch.devices import Devices, tpu_devices
from tests.conftest import FAULTY_RECIPE, REPO, metrics_of, run_train, write_spec
from tests.conftest import usage_error as _usage_error

HAS_XLA = importlib.util.find_spec("torch_xla") is not None
if os.environ.get("LAUNCHER_REQUIRE_XLA") == "1" and not HAS_XLA:
    raise RuntimeError("LAUNCHER_REQUIRE_XLA=1, but torch_xla is not importable here")
needs_xla = pytest.mark.skipif(not HAS_XLA, reason="torch_xla is not installed here")
pytestmark = [pytest.mark.timeout(400), pytest.mark.xla]

XLA_CPU = {"PJRT_DEVICE": "CPU"}
STEPS = 20


def _spec(folder: Path, strategy: str, devices: int, **sections: dict) -> Path:
    """The mlp recipe on XLA; 500 samples: not a multiple of any batch used here."""
    folder.mkdir(parents=True, exist_ok=True)
    base = {
        "launch": {"accelerator": "tpu", "devices": devices, "strategy": strategy},
        "recipe": {"source": str(REPO / "recipes" / "mlp.py"), "dataset": {"n_samples": 500}},
        "optim": {"name": "AdamW", "lr": 0.01},
        "train": {"max_steps": STEPS, "log_every": 1},
        "checkpoint": {"every_n_steps": 10},
    }
    return write_spec(folder / "run.yaml", base, **sections)


def _train(  # type: ignore[no-untyped-def]
    folder: Path, spec: Path, *args: str, timeout: float = 240, env: dict[str, str] | None = None
):
    env = XLA_CPU | (env or {})
    return run_train(["--config", str(spec), *args], cwd=folder, timeout=timeout, env=env)


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics_of(run)}


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@needs_xla
def test_xla_end_to_end_with_logs_checkpoint_and_exact_resume(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "xla", 1, train={"log_every": 5})
    first = _train(tmp_path, spec, "--run-dir", str(tmp_path / "a"))
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"[rank 0] step {STEPS}/{STEPS} | loss" in first.stdout
    run = tmp_path / "a"
    log = (run / "logs" / "rank-0.log").read_text()
    assert "xla on 1 x xla" in log and f"step {STEPS}/{STEPS}" in log
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step-00000010", "step-00000020"]
    assert _summary(run)["xla_compilations"] > 0

    resumed = _train(
        tmp_path,
        spec,
        "--resume",
        str(run / "checkpoints" / "step-00000010"),
        "--run-dir",
        str(tmp_path / "b"),
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed at step 10" in resumed.stdout
    before, after = _losses(run), _losses(tmp_path / "b")
    assert sorted(after) == [15, 20]
    assert all(after[s] == before[s] for s in after), (before, after)


def _gpt_spec(folder: Path, strategy: str, devices: int, batch_size: int) -> Path:
    """A tiny GPT with dropout (XLA's own RNG), AdamW with parameter groups, a schedule,
    accumulation, clipping, the weights' average."""
    return _spec(
        folder,
        strategy,
        devices,
        recipe={
            "source": str(REPO / "recipes" / "gpt.py"),
            "model": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "dropout": 0.1},
            "dataset": {"block_size": 16, "max_bytes": 4000},
        },
        data={"batch_size": batch_size, "shuffle": True},
        optim={
            "name": "AdamW", "lr": 3e-3, "schedule": "cosine", "warmup_steps": 3,
            "kwargs": {"weight_decay": 0.1},
            "groups": [{"params": ["*.bias", "*ln_*.weight"], "weight_decay": 0.0}],
        },
        train={
            "max_steps": 12, "grad_accum_steps": 2, "log_every": 2, "grad_clip_norm": 1.0,
            # The average on sharded weights; xla_spmd's are whole, as ddp's.
            "ema": {"decay": 0.9} if strategy == "xla_fsdp" else None,
        },
        checkpoint={"every_n_steps": 5},
    )  # fmt: skip


@needs_xla
@pytest.mark.parametrize("strategy", ["xla_spmd", "xla_fsdp"])
def test_spmd_resume_is_exact_with_dropout_and_sharded_optimizer_state(
    tmp_path: Path, strategy: str
) -> None:
    spec = _gpt_spec(tmp_path, strategy, devices=4, batch_size=2)
    first = _train(tmp_path, spec, "--run-dir", str(tmp_path / "a"))
    assert first.returncode == 0, first.stdout + first.stderr
    resumed = _train(
        tmp_path,
        spec,
        "--resume",
        str(tmp_path / "a" / "checkpoints" / "step-00000005"),
        "--run-dir",
        str(tmp_path / "b"),
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    before, after = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert sorted(after) == [6, 8, 10, 12]
    if strategy == "xla_spmd":
        assert all(after[s] == before[s] for s in after), (before, after)
    else:
        # FSDPv2: XLA partitions the resumed run's graphs (restored, sharded optimizer state)
        # with other reduction orders, so values agree to float rounding, not bit for bit.
        assert all(after[s] == pytest.approx(before[s], rel=1e-6) for s in after)
        assert after[6] == before[6]
    # No recompilation warnings in either run, resumed or not.
    assert "XLA compiled" not in first.stdout + resumed.stdout
    assert _summary(tmp_path / "b")["xla_compilations_after_warmup"] == 0


@needs_xla
@pytest.mark.parametrize("strategy", ["xla_spmd", "xla_fsdp"])
def test_spmd_on_4_devices_matches_one_device_on_the_same_global_batch(
    tmp_path: Path, strategy: str
) -> None:
    # The reference is another backend altogether: plain torch on the CPU, one process.
    ref_spec = _spec(
        tmp_path / "ref", "ddp", 1, launch={"accelerator": "cpu"}, data={"batch_size": 32}
    )
    ref = _train(tmp_path, ref_spec, "--run-dir", str(tmp_path / "ref" / "run"))
    assert ref.returncode == 0, ref.stdout + ref.stderr
    spec = _spec(tmp_path / "spmd", strategy, 4, data={"batch_size": 8})
    result = _train(tmp_path, spec, "--run-dir", str(tmp_path / "spmd" / "run"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{strategy} on 4 x xla" in result.stdout
    assert "and 3 more devices" in result.stdout
    expected, got = _losses(tmp_path / "ref" / "run"), _losses(tmp_path / "spmd" / "run")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], abs=1e-4), step
    assert expected[STEPS] < expected[1] * 0.8  # and it trained


def _compilations(tmp_path: Path, name: str, steps: int) -> dict:
    spec = _spec(
        tmp_path / name,
        "xla_fsdp",
        2,
        data={"batch_size": 8, "drop_last": False},  # 500 = 31 * 16 + 4: a short last batch
        train={"max_steps": steps, "log_every": 3},
        checkpoint={"every_n_steps": 7},  # saves between log lines, and on them
    )
    result = _train(tmp_path, spec, "--run-dir", str(tmp_path / name / "run"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "data.drop_last=false is ignored on TPU" in result.stderr + result.stdout
    assert "XLA compiled" not in result.stdout
    return _summary(tmp_path / name / "run")


@needs_xla
def test_compilations_are_bounded_and_do_not_grow_with_steps(tmp_path: Path) -> None:
    # 31 steps per epoch: the long run crosses two epoch ends, logs every 3 steps and saves 10
    # checkpoints, and still compiles exactly the graphs of the short one.
    short, long = _compilations(tmp_path, "short", 5), _compilations(tmp_path, "long", 70)
    assert long["xla_compilations"] == short["xla_compilations"] <= 6
    assert long["xla_compilations_after_warmup"] == 0
    assert long["xla_compile_s"] > 0


@needs_xla
@pytest.mark.parametrize("strict", [False, True])
def test_a_recompilation_after_warmup_is_named_and_strict_stops_the_run(
    tmp_path: Path, strict: bool
) -> None:
    (tmp_path / "shapes.py").write_text(FAULTY_RECIPE)  # FAULT=shrink: a new shape at step 9
    spec = _spec(
        tmp_path,
        "xla",
        1,
        recipe={"source": "shapes.py", "dataset": {}},
        train={"max_steps": 12, "log_every": 2},
        checkpoint={"enabled": False},
    )
    args = ["--strict-compile"] if strict else []
    result = _train(tmp_path, spec, *args, env={"FAULT": "shrink", "FAULT_AT": "9"})
    output = result.stdout + result.stderr
    assert "step 9: XLA compiled 1 new graph after warm-up" in output
    assert "Traceback" not in output
    if strict:
        assert result.returncode == 1, output
        assert "step 10/12" not in output
    else:
        assert result.returncode == 0, output
        assert "step 12/12" in output


@needs_xla
def test_bf16_trains_on_xla(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "xla_spmd", 2, train={"precision": "bf16", "max_steps": 8})
    result = _train(tmp_path, spec, "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stdout + result.stderr
    losses = _losses(tmp_path / "run")
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert losses[8] < losses[1]


@pytest.mark.skipif(HAS_XLA, reason="checks an environment without torch_xla")
def test_tpu_without_torch_xla_says_how_to_install_it(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "xla", 1)
    result = run_train(["--config", str(spec)], cwd=tmp_path, timeout=60)
    _usage_error(result, "torch_xla is not installed", "pip install 'torch==2.9.0' 'torch_xla[tpu]")


@needs_xla
def test_tpu_without_a_tpu_says_so_and_how_to_use_the_cpu(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "xla_fsdp", 1)
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    result = run_train(
        ["--config", str(spec)], cwd=tmp_path, timeout=60, env=env | {"PJRT_DEVICE": "TPU"}
    )
    _usage_error(result, "no TPU is attached to this machine", "PJRT_DEVICE=CPU")


@needs_xla
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--devices", "2"], "collectives hang"),
        (["train.precision=fp16"], "train.precision: fp16 is not supported on TPU"),
        (["checkpoint.async=true"], "checkpoint.async: not available with strategy xla"),
        (["--accelerator", "cpu"], "strategy 'xla' runs on TPUs through torch_xla"),
    ],
)
def test_xla_bad_inputs(tmp_path: Path, args: list[str], expected: str) -> None:
    spec = _spec(tmp_path, "xla", 1)
    _usage_error(_train(tmp_path, spec, *args, timeout=60), expected)


def test_tpu_devices_are_counted_from_the_pci_bus(tmp_path: Path) -> None:
    def device(name: str, vendor: str, dev: str) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendor").write_text(vendor + "\n")
        (tmp_path / name / "device").write_text(dev + "\n")

    device("0000:00:04.0", "0x1ae0", "0x005e")  # v4: one device per chip
    device("0000:00:05.0", "0x1ae0", "0x005e")
    device("0000:00:06.0", "0x1ae0", "0x0027")  # v3: two
    device("0000:00:07.0", "0x10de", "0x2330")  # a GPU
    device("0000:00:08.0", "0x1ae0", "0x0001")  # Google, not a TPU
    assert tpu_devices(tmp_path) == 4
    assert tpu_devices(tmp_path / "nowhere") == 0


def test_the_compile_cache_goes_in_the_run_dir_on_tpu_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from launcher.config.loader import load_cli_spec
    from launcher.launch.plan import LaunchPlan

    plan = LaunchPlan(
        spec=load_cli_spec(_spec(tmp_path, "xla_fsdp", 4)),
        run_dir=tmp_path / "run",
        accelerator="tpu",
        devices=Devices(4, 1, 1, env={"CPU_NUM_DEVICES": "4"}),
        resume_from=None,
        show_ranks=None,
        omp_threads=1,
    )
    monkeypatch.delenv("XLA_PERSISTENT_CACHE_PATH", raising=False)
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert plan.worker_plan().compile_cache == tmp_path / "run" / "xla_cache"
    monkeypatch.setenv("XLA_PERSISTENT_CACHE_PATH", str(tmp_path / "mine"))  # the user's wins
    assert plan.worker_plan().compile_cache == tmp_path / "mine"
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # XLA's CPU client cannot reload executables
    assert plan.worker_plan().compile_cache is None
    env = plan.worker_env()
    assert env["CPU_NUM_DEVICES"] == "4"


@needs_xla
def test_xla_replica_failure_shows_the_users_traceback(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text(FAULTY_RECIPE)
    spec = _spec(tmp_path, "xla", 1, recipe={"source": "broken.py", "dataset": {}})
    result = _train(tmp_path, spec, env={"FAULT": "raise", "FAULT_RANK": "0"})
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "RuntimeError: boom on rank 0" in output
    assert "rank 0 failed" in output


@needs_xla
def test_adam_runs_hundreds_of_steps_without_a_new_graph(tmp_path: Path) -> None:
    # Adam's bias correction 1 - 0.95**step reaches exactly 1.0 in float32 at step 325; as a
    # Python float that would be a new constant in the graph, and a compile.
    spec = _spec(
        tmp_path,
        "xla_spmd",
        2,
        optim={"name": "AdamW", "lr": 1e-3, "kwargs": {"betas": [0.9, 0.95]}},
        train={"max_steps": 340, "log_every": 50},
        checkpoint={"enabled": False},
    )
    result = _train(tmp_path, spec, "--strict-compile", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert _summary(tmp_path / "run")["xla_compilations_after_warmup"] == 0

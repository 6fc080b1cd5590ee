"""`train.float8`: which runs may train in float8 (a GPU with float8 tensor cores, torchao, no
tensor parallelism), and which of a model's layers become torchao's `Float8Linear`, checked
on a model built on the meta device. The float8 step itself needs such a GPU:
bench/gpu_bench.py measures it against bf16 (BENCHMARKS.md). On CPU the launch is refused in
one line (tests/cli/test_bad_inputs.py)."""

from __future__ import annotations

import enum
import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from launcher.errors import UsageError
from launcher.parallel import float8
from launcher.worker.recipe import load_recipe
from tests.conftest import REPO, run_train, write_spec
from tests.forked_train import train_in_fork

HOPPER, AMPERE = (9, 0), (8, 0)


def test_float8_runs_on_gpus_with_float8_tensor_cores_only() -> None:
    if importlib.util.find_spec("torchao") is not None:
        assert float8.refusal("gpu", 1, HOPPER) is None
    for accelerator in ("cpu", "tpu"):
        assert f"this run is on {accelerator}" in float8.refusal(accelerator, 1, HOPPER)
    assert "compute capability 8.0" in float8.refusal("gpu", 1, AMPERE)
    assert "parallel.tp: 2" in float8.refusal("gpu", 2, HOPPER)
    with pytest.raises(UsageError) as refused:
        float8.check("gpu", 1, AMPERE)
    assert "train.float8: false" in refused.value.hint


def test_without_torchao_the_refusal_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = importlib.util.find_spec
    monkeypatch.setattr(
        float8.importlib.util, "find_spec", lambda name: None if name == "torchao" else found(name)
    )
    with pytest.raises(UsageError) as refused:
        float8.check("gpu", 1, HOPPER)
    assert "needs torchao" in str(refused.value)
    assert "launcher[float8]" in refused.value.hint


def test_the_large_linear_layers_become_float8_and_the_head_stays() -> None:
    pytest.importorskip("torchao")
    recipe = load_recipe(str(REPO / "recipes" / "gpt.py"))
    with torch.device("meta"):
        model = recipe.build_model(n_layer=2, n_head=8, n_embd=1024, block_size=32)
    names = dict(model.state_dict())
    line = float8.convert(model)
    kinds = {
        name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, nn.Linear)
    }
    # torchao's tensorwise filter: an output of at most 1024 features and an input of at most
    # 4096 gains nothing (the attention and MLP output projections here); the head stays.
    assert kinds == {
        **{f"blocks.{i}.attn.qkv": "Float8Linear" for i in range(2)},
        **{f"blocks.{i}.mlp.fc": "Float8Linear" for i in range(2)},
        **{f"blocks.{i}.attn.proj": "Linear" for i in range(2)},
        **{f"blocks.{i}.mlp.proj": "Linear" for i in range(2)},
        "lm_head": "Linear",
    }
    assert line.startswith("train.float8: 4 of 9 linear layers in float8")
    assert "the output head (lm_head)" in line
    # The same parameters under the same names, still on meta: checkpoints move between float8
    # and bf16 runs, and fsdp's meta init materialises them as before.
    assert list(model.state_dict()) == list(names)
    assert all(p.device.type == "meta" for p in model.parameters())


# --- what torchao says as transformers imports it, in a run without float8 ------------------

_TORCHAO_NOISE = ("Failed to load ", "register_constant() on Enum subclasses is deprecated")


@pytest.mark.timeout(180)
def test_a_hugging_face_run_without_float8_prints_nothing_of_torchaos_import(
    tmp_path: Path,
) -> None:
    """transformers imports torchao wherever it is installed, so a Hugging Face recipe printed
    torchao's two `Failed to load .../torchao/_C_mxfp8...so` lines and two pytree deprecation
    warnings in `train validate`, in `train` and again in every rank."""
    pytest.importorskip("transformers")
    pytest.importorskip("torchao")
    imported = subprocess.run(
        [sys.executable, "-c", "import transformers.modeling_utils"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if not any(noise in imported.stderr for noise in _TORCHAO_NOISE):
        pytest.skip("this torchao says nothing as it is imported: nothing to keep quiet")
    recipe = {"source": str(REPO / "recipes" / "hf_gpt2.py"), "model": {"n_layer": 1}}
    spec = write_spec(tmp_path / "run.yaml", recipe=recipe, train={"max_steps": 2})
    validated = train_in_fork(["validate", "--config", str(spec)], tmp_path)
    ran = run_train(["--config", str(spec)], tmp_path)
    logs = [log.read_text() for log in (tmp_path / "runs").rglob("logs/rank-*.log")]
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert ran.returncode == 0 and len(logs) == 2, ran.stdout + ran.stderr
    for said in (validated.stdout + validated.stderr, ran.stdout + ran.stderr, *logs):
        assert not [noise for noise in _TORCHAO_NOISE if noise in said], said


def test_only_torchaos_import_noise_is_dropped_and_float8_keeps_its_kernels_word(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    for logger in (torchao, pytree):
        monkeypatch.setattr(logger, "filters", [])  # this test's filters end with it

    class KernelPreference(enum.Enum):  # torchao's, by its module
        AUTO = "auto"

    KernelPreference.__module__ = "torchao.quantization.quantize_.common.kernel_preference"

    class Mine(enum.Enum):
        A = 1

    deprecated = (
        "%s is an Enum subclass and is now natively supported by torch.compile as an opaque "
        "value type. Calling register_constant() on Enum subclasses is deprecated and will be "
        "an error in a future release."
    )
    unloaded = "Failed to load /site-packages/torchao/_C_mxfp8.so: Could not load this library"

    def said(float8_on: bool) -> list[str]:
        float8.quiet_torchao_import(float8_on)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            torchao.warning(unloaded)
            torchao.warning("Skipping import of cpp extensions due to incompatible torch")
            pytree.warning(deprecated, KernelPreference)
            pytree.warning(deprecated, Mine)
        return [record.getMessage() for record in caplog.records]

    others = ["Skipping import of cpp extensions due to incompatible torch", deprecated % Mine]
    assert said(float8_on=False) == others
    assert said(float8_on=True) == [unloaded, *others]  # one filter, the newest word
    assert len(torchao.filters) == len(pytree.filters) == 1

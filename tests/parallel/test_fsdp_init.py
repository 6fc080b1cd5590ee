"""fsdp starts from the weights ddp starts from (`fsdp.init`), picks shard units itself, and
trains Hugging Face models. Initial weights are read from real `train` runs: a recipe wrapper
gathers every parameter and buffer (DTensor shards made whole) at the first loss call, before
any update, and rank 0 saves them."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from torch import nn

from launcher.errors import UsageError
from launcher.parallel.precision import cpu_has_fast_bf16
from launcher.parallel.shard_units import shard_units
from launcher.parallel.sharded_init import MetaBuildFailed, build_on_meta
from tests.conftest import REPO, metrics_of, only_run_dir, run_train, write_spec
from tests.tiny_recipes import write_recipe

pytestmark = pytest.mark.timeout(300)

# Wraps the recipe at $BASE_RECIPE; its init_weights, if any, stays the recipe's.
CAPTURE = """
import importlib.util, os
import torch

_spec = importlib.util.spec_from_file_location("base_recipe", os.environ["BASE_RECIPE"])
_spec.loader.exec_module(base := importlib.util.module_from_spec(_spec))
build_model, build_dataset = base.build_model, base.build_dataset
if hasattr(base, "init_weights"):
    init_weights = base.init_weights
calls = 0

def loss(model, batch):
    global calls
    calls += 1
    if calls == 1:
        inner = getattr(model, "module", model)  # ddp's wrapper
        tensors = [*inner.named_parameters(), *inner.named_buffers()]
        whole = {n: getattr(t, "full_tensor", t.detach)().detach().clone() for n, t in tensors}
        if os.environ["RANK"] == "0":
            torch.save(whole, os.environ["INIT_OUT"])
    return base.loss(model, batch)
"""

# torchvision's ResNet in small: BasicBlocks in nn.Sequential (no ModuleList), and its own
# init in a loop in the constructor (kaiming_normal_ is not Conv2d.reset_parameters()).
CNN = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

class BasicBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))

class Net(nn.Module):
    def __init__(self, width=8, blocks=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.layers = nn.Sequential(*[BasicBlock(width) for _ in range(blocks)])
        self.fc = nn.Linear(width, 4)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))

def build_model():
    return Net()

def build_dataset(split):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 3, 8, 8, generator=g), torch.randint(4, (64,), generator=g))

def loss(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])
"""

# The recipe defines the init: exact on the meta device.
CNN_WITH_INIT = (
    CNN
    + """

def init_weights(model):
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.xavier_uniform_(m.weight)
        elif isinstance(m, nn.BatchNorm2d):
            m.reset_parameters()
        elif isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
"""
)

# An init_weights() that does not write a buffer its constructor computes (rotary frequencies),
# on the tiny recipe's data (8 features in and out) and loss.
ROTARY = """
import torch
from torch import nn

class Rotary(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        freqs = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
        self.register_buffer("freqs", freqs, persistent=False)

    def init_weights(self):
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x):
        return self.proj(x) * self.freqs.repeat(2)

def build_model():
    return Rotary()

def build_dataset(split):
    return tiny.build_dataset(split, n_samples=64, width=8, out_width=8)
"""

# A model whose constructor reads a weight's value, which the meta device does not hold; the
# tiny recipe's data and loss.
READS_A_WEIGHT = """
import torch
from torch import nn

class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)
        self.scale = float(self.a.weight.abs().max().item())
        if self.b.weight.sum() > 0:  # a branch on a weight's value
            self.scale *= 2

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) * self.scale

def build_model():
    return Scaled()
"""


class Run(NamedTuple):
    initial: dict | None  # every parameter and buffer at the first loss call, whole
    output: str
    losses: list[float]
    returncode: int


def _run(folder: Path, base: Path, strategy: str, *extra: str, steps: int = 1) -> Run:
    """Trains `base` (a recipe file) through the capture wrapper."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "capture.py").write_text(CAPTURE)
    spec = write_spec(
        folder / "run.yaml",
        launch={"strategy": strategy},
        recipe={"source": "capture.py", "dataset": {}},
        data={"batch_size": 4},
        optim={"name": "AdamW", "lr": 1e-3},
        train={"max_steps": steps, "log_every": 1},
        checkpoint={"enabled": False},
    )
    out = folder / "initial.pt"
    env = {"BASE_RECIPE": str(base), "INIT_OUT": str(out)}
    result = run_train(["--config", str(spec), *extra], cwd=folder, env=env)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        return Run(None, output, [], result.returncode)
    losses = [r["loss"] for r in metrics_of(only_run_dir(folder / "runs"))]
    return Run(torch.load(out), output, losses, result.returncode)


def _differ(a: dict | None, b: dict | None) -> list[str]:
    assert a is not None and b is not None and a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def _plain_build(path: Path, seed: int = 0) -> dict:
    """What ddp builds, independently of the launcher: seed, construct, then (where the recipe
    or model has one) seed again and run the explicit init."""
    spec = importlib.util.spec_from_file_location(f"ref_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    torch.manual_seed(seed)  # python's and numpy's generators: unused by these models
    model = module.build_model()
    torch.manual_seed(seed)
    with torch.no_grad():
        if hasattr(module, "init_weights"):
            module.init_weights(model)
        elif hasattr(model, "init_weights"):
            model.init_weights()
    return {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.fixture(scope="module")
def cnn(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("cnn")
    (base := tmp / "cnn.py").write_text(CNN)
    runs = {s: _run(tmp / s, base, s) for s in ("ddp", "fsdp")}
    runs["meta"] = _run(tmp / "meta", base, "fsdp", "fsdp.init=meta")
    return runs


def test_a_cnn_that_initialises_in_its_constructor_starts_as_under_ddp(cnn: dict) -> None:
    ddp, fsdp = cnn["ddp"], cnn["fsdp"]
    assert _differ(ddp.initial, fsdp.initial) == [], fsdp.output
    assert "fsdp.init: auto: Net has no explicit initialisation" in fsdp.output
    assert "every process builds the whole model on CPU as ddp does" in fsdp.output
    size = sum(t.numel() * t.element_size() for t in ddp.initial.values()) / 1024
    assert f"{size:.1f} KiB of host memory per process, {2 * size:.1f} KiB for the 2" in (
        fsdp.output
    )


def test_meta_without_an_explicit_init_says_it_is_not_proven(cnn: dict) -> None:
    ddp, meta = cnn["ddp"], cnn["meta"]
    assert "not proven equal to a plain build (ddp)" in meta.output
    # Why `auto` does not take this path: reset_parameters() is not the constructor's init.
    assert _differ(ddp.initial, meta.initial) == [
        "stem.0.weight",
        *(f"layers.{i}.conv{j}.weight" for i in range(3) for j in (1, 2)),
    ]


def test_shard_units_of_a_model_without_a_module_list_are_its_repeated_blocks(cnn: dict) -> None:
    output = cnn["fsdp"].output
    line = "fsdp: shard units: 3 x BasicBlock (repeated blocks; fsdp.wrap names others), "
    assert line + "and the root Net" in output


@pytest.mark.smoke
def test_meta_init_from_the_recipes_init_weights_equals_a_plain_build(tmp_path: Path) -> None:
    (base := tmp_path / "cnn_init.py").write_text(CNN_WITH_INIT)
    meta = _run(tmp_path / "run", base, "fsdp", "fsdp.init=meta")
    assert "fsdp.init: meta: the recipe's init_weights(model) initialised each rank's shards" in (
        meta.output
    )
    assert _differ(_plain_build(base), meta.initial) == []


def test_auto_builds_on_cpu_where_the_init_leaves_a_buffer_unset(tmp_path: Path) -> None:
    base = write_recipe(tmp_path, ROTARY, "rotary.py")
    auto = _run(tmp_path / "auto", base, "fsdp")
    line = "fsdp.init: auto: Rotary.init_weights() leaves freqs unset on the meta device"
    assert line in auto.output
    assert "each rank's shards (meta device)" not in auto.output  # one true line, not two
    assert _differ(_plain_build(base), auto.initial) == []
    meta = _run(tmp_path / "meta", base, "fsdp", "fsdp.init=meta")
    assert meta.returncode == 2 and "Traceback" not in meta.output, meta.output
    assert "fsdp.init: meta: the model is built on the meta device, and its " in meta.output
    assert "initialisation left freqs unset" in meta.output and "fsdp.init: cpu" in meta.output


def test_auto_builds_on_cpu_a_model_the_meta_device_cannot_build(tmp_path: Path) -> None:
    base = write_recipe(tmp_path, READS_A_WEIGHT, "scaled.py")
    auto = _run(tmp_path / "auto", base, "fsdp")
    assert auto.returncode == 0, auto.output
    line = (
        "fsdp.init: auto: the model cannot be built on the meta device (RuntimeError: "
        "Tensor.item() cannot be called on meta tensors), so it is built as under fsdp.init: cpu"
    )
    assert line in auto.output
    assert "every process builds the whole model on CPU as ddp does" in auto.output
    assert _differ(_plain_build(base), auto.initial) == []


def _reads_a_weight(layer: nn.Linear) -> float:
    return float(layer.weight.abs().max().item())


def _branches_on_a_weight(layer: nn.Linear) -> float:
    return 1.0 if layer.weight.sum() > 0 else 2.0


@pytest.mark.parametrize("read", [_reads_a_weight, _branches_on_a_weight], ids=["item", "if"])
def test_a_constructor_that_reads_a_weight_fails_on_meta_naming_fsdp_init(
    read: Callable[[nn.Linear], float],
) -> None:
    def build() -> nn.Module:
        layer = nn.Linear(4, 4)
        layer.scale = read(layer)
        return layer

    with pytest.raises(MetaBuildFailed) as failed:
        build_on_meta(build)
    assert failed.value.exit_code == 2
    assert failed.value.message.startswith(
        "fsdp.init: meta: the model cannot be built on the meta device (RuntimeError: "
    )
    assert "fsdp.init: cpu" in failed.value.hint
    assert build_on_meta(lambda: nn.Linear(4, 4)).weight.is_meta


def test_a_usage_error_of_the_recipe_passes_through_the_meta_build() -> None:
    def build() -> nn.Module:
        raise UsageError("recipe.model: bad keyword")

    with pytest.raises(UsageError) as raised:
        build_on_meta(build)
    assert not isinstance(raised.value, MetaBuildFailed)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("gpt2")
    base = REPO / "recipes" / "hf_gpt2.py"
    return {
        "ddp": _run(tmp / "ddp", base, "ddp", steps=4),
        "fsdp": _run(tmp / "fsdp", base, "fsdp", "fsdp.wrap=[GPT2Block]", steps=4),
    }


def test_hf_gpt2_starts_as_under_ddp_with_its_own_init(gpt2: dict) -> None:
    ddp, fsdp = gpt2["ddp"], gpt2["fsdp"]
    assert "fsdp.init: auto: GPT2LMHeadModel's Hugging Face init initialised each rank's" in (
        fsdp.output
    )
    assert _differ(ddp.initial, fsdp.initial) == []
    # GPT-2's scheme: residual projections at 0.02 / sqrt(2 * n_layer) = 0.01 (n_layer 2).
    weights = ddp.initial
    for name in ("attn.c_proj", "mlp.c_proj"):
        std = weights[f"transformer.h.1.{name}.weight"].std().item()
        assert abs(std - 0.01) < 0.001, (name, std)
    std = weights["transformer.h.1.attn.c_attn.weight"].std().item()
    assert abs(std - 0.02) < 0.001, std


def test_an_hf_model_with_dict_batches_trains_under_ddp_and_fsdp(gpt2: dict) -> None:
    ddp, fsdp = gpt2["ddp"].losses, gpt2["fsdp"].losses
    line = "fsdp: shard units: 2 x GPT2Block (fsdp.wrap), and the root GPT2LMHeadModel"
    assert line in gpt2["fsdp"].output
    assert len(ddp) == len(fsdp) == 4 and fsdp[-1] < fsdp[0]
    torch.testing.assert_close(torch.tensor(fsdp), torch.tensor(ddp), rtol=0, atol=1e-5)


def test_hf_models_are_sharded_by_their_no_split_modules() -> None:
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=8, n_layer=3, n_head=2, vocab_size=16, n_positions=8)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    units = shard_units(model, None)
    assert units.describe(model) == (
        "fsdp: shard units: 3 x GPT2Block (the model's _no_split_modules), "
        "and the root GPT2LMHeadModel"
    )


class _Tied(nn.Module):
    """Repeated Linear layers, one of which shares its weight with the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 8, bias=False)
        self.head.weight = self.emb.weight


def test_leaf_layers_are_units_where_no_block_repeats_but_never_a_tied_one() -> None:
    model = _Tied()
    units = shard_units(model, None)
    assert units.modules == [model.body[2], model.body[0]]
    assert units.describe(model).startswith("fsdp: shard units: 2 x Linear (repeated layers")


def test_a_model_of_one_unit_says_so_and_names_fsdp_wrap() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    line = shard_units(model, None).describe(model)
    assert line.startswith("fsdp: the whole model is one shard unit")
    assert "fsdp.wrap" in line and "Linear, ReLU, Sequential" in line


@pytest.mark.parametrize(
    ("flags", "fast"),
    [
        ("flags\t\t: fpu sse avx2 avx512f avx512bw\n", False),
        ("flags\t\t: fpu avx2 avx512f avx512_bf16\n", True),
        ("flags\t\t: fpu avx2 amx_bf16 amx_tile\n", True),
        ("Features\t: fp asimd sve bf16\n", True),
        ("Features\t: fp asimd\n", False),
    ],
)
def test_cpus_without_native_bf16_are_recognised(flags: str, fast: bool) -> None:
    assert cpu_has_fast_bf16("processor\t: 0\n" + flags) is fast

"""Strategy `fsdp`: the same numbers as ddp, exact resume, and its options. (Resuming on
another number of processes is tested for both strategies in test_resume.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoint.test_resume import GPT_SMALL, _assert_bitwise, _gpt_spec, _losses, _weights
from tests.conftest import metrics_of, only_run_dir, run_train, write_spec

pytestmark = pytest.mark.timeout(300)
GPT = GPT_SMALL


def _gpt_run(folder: Path, strategy: str, *extra: str) -> list[float]:
    folder.mkdir(parents=True, exist_ok=True)
    spec = write_spec(
        folder / "run.yaml",
        launch={"strategy": strategy},
        recipe=GPT,
        data={"batch_size": 4, "shuffle": True},
        optim={"name": "AdamW", "lr": 1e-3},
        train={"max_steps": 20, "log_every": 1, "grad_clip_norm": 1.0},
    )
    result = run_train(["--config", str(spec), *extra], cwd=folder)
    assert result.returncode == 0, result.stdout + result.stderr
    return [r["loss"] for r in metrics_of(only_run_dir(folder / "runs"))]


@pytest.fixture(scope="module")
def fsdp_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return _gpt_run(tmp_path_factory.mktemp("fsdp"), "fsdp")


def test_fsdp_equals_ddp_for_20_steps(tmp_path: Path, fsdp_losses: list[float]) -> None:
    ddp = _gpt_run(tmp_path, "ddp")
    assert len(ddp) == len(fsdp_losses) == 20
    # Step 1's loss is computed with the initial weights: the sharded meta-device init
    # reproduced the unsharded one.
    torch.testing.assert_close(torch.tensor(fsdp_losses), torch.tensor(ddp), rtol=0, atol=1e-5)


def test_checkpointing_and_zero2_do_not_change_the_numbers(
    tmp_path: Path, fsdp_losses: list[float]
) -> None:
    losses = _gpt_run(
        tmp_path, "fsdp", "fsdp.activation_checkpointing=true", "fsdp.reshard_after_forward=false"
    )
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(fsdp_losses), rtol=0, atol=1e-6)


def test_bf16_parameters_train(tmp_path: Path) -> None:
    losses = _gpt_run(tmp_path, "fsdp", "fsdp.param_dtype=bf16", "fsdp.reduce_dtype=fp32")
    assert all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.smoke
def test_fsdp_resume_is_bitwise_exact(tmp_path: Path) -> None:
    spec = _gpt_spec(tmp_path)
    ref = tmp_path / "ref"
    first = run_train(
        ["--config", str(spec), "--strategy", "fsdp", "--run-dir", str(ref)], cwd=tmp_path
    )
    assert first.returncode == 0, first.stdout + first.stderr
    branch = tmp_path / "branch"
    result = run_train(
        [
            "--config",
            str(spec),
            "--strategy",
            "fsdp",
            "--resume",
            str(ref / "checkpoints" / "step-00000005"),
            "--run-dir",
            str(branch),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ours, theirs = _losses(branch), _losses(ref)
    assert ours and all(ours[s] == theirs[s] for s in ours)
    final = "checkpoints/step-00000020"
    _assert_bitwise(
        _weights(branch / final, tmp_path / "a.pt"), _weights(ref / final, tmp_path / "b.pt")
    )


def test_wrap_classes_that_match_nothing_list_the_real_ones(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml", launch={"strategy": "fsdp"}, recipe=GPT)
    result = run_train(["--config", str(spec), "fsdp.wrap=[Blok]"], cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "fsdp.wrap: Blok matches no module of the model" in result.stdout
    assert "Module classes in this model: Block, CausalSelfAttention," in result.stdout


def test_parameters_the_init_leaves_unset_are_an_error_not_garbage(tmp_path: Path) -> None:
    """nn.MultiheadAttention initialises in a private _reset_parameters, and a bare
    nn.Parameter in __init__ is lost on the meta device: fsdp.init=meta must say so (auto
    builds such a model on the CPU instead)."""
    (tmp_path / "mha.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "from torch.utils.data import TensorDataset\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.pos = nn.Parameter(torch.randn(4, 8))\n"
        "        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)\n"
        "    def forward(self, x):\n"
        "        h = x.view(-1, 4, 8) + self.pos\n"
        "        return self.attn(h, h, h)[0].mean((1, 2))\n"
        "def build_model():\n"
        "    return M()\n"
        "def build_dataset(split):\n"
        "    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))\n"
        "    return TensorDataset(x, x.sum(1))\n"
        "def loss(model, batch):\n"
        "    return nn.functional.mse_loss(model(batch[0]), batch[1])\n"
    )
    spec = write_spec(
        tmp_path / "run.yaml",
        launch={"strategy": "fsdp"},
        recipe={"source": "mha.py", "dataset": {}},
        data={"batch_size": 4},
    )
    result = run_train(["--config", str(spec), "fsdp.init=meta"], cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "left pos, attn.in_proj_weight, attn.in_proj_bias unset" in result.stdout
    assert "init_weights" in result.stdout

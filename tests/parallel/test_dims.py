"""Parallelism as dimensions (`parallel`): HSDP and tensor parallelism on one device mesh, 4
processes on gloo, against ddp. Losses agree because every layout sees the same global batch:
`data.batch_size` is per data-parallel rank, and the processes of a tensor-parallel group
share one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.config.parallel import ParallelSection
from launcher.errors import UsageError
from launcher.parallel.dims import ParallelDims, resolve_dims
from tests.conftest import REPO, metrics_of, usage_error
from tests.forked_train import train_in_fork
from tests.launch.test_multinode import finish_nodes, start_nodes
from tests.parallel.layouts import (
    GPT,
    assert_close,
    assert_exports_alike,
    curves,
    resumes_as_ddp,
    spec_file,
    train,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tp_and_ddp(ddp_on_2: Path) -> tuple[Path, str]:
    """tp 2 x dp_shard 2 on 4 processes, 20 steps of the global batch of ddp on 2 (`ddp_on_2`,
    in the same folder); the folder, and the tp run's output."""
    probe = {**GPT, "source": "probe.py"}  # a resume continues with the recipe it started with
    tp = spec_file(ddp_on_2 / "tp.yaml", 4, "fsdp", parallel={"tp": 2}, recipe=probe)
    return ddp_on_2, train(ddp_on_2, tp, "tp").stdout


@pytest.mark.smoke
def test_tensor_parallel_matches_ddp_on_the_same_global_batch(
    tp_and_ddp: tuple[Path, str],
) -> None:
    folder, output = tp_and_ddp
    assert "fsdp (dp_shard 2 x tp 2) on 4 x cpu" in output
    assert "tensor parallel over 2 processes: the recipe's parallelize" in output
    # The losses, the clipped gradients' global norm and the exact evaluation mean are ddp's.
    for ours, theirs in zip(curves(folder / "tp"), curves(folder / "ddp"), strict=True):
        assert_close(ours, theirs, rel=1e-4)
    # One batch per tensor-parallel group (ranks 0-1, 2-3), and a different one per group.
    seen = [(folder / f"batches-{rank}.txt").read_text().split() for rank in range(4)]
    assert len(seen[0]) == 20 and seen[0] == seen[1] and seen[2] == seen[3]
    assert all(a != b for a, b in zip(seen[0], seen[2], strict=True))


def test_a_tensor_parallel_checkpoint_resumes_in_other_layouts_and_exports_whole(
    tp_and_ddp: tuple[Path, str],
) -> None:
    folder, _ = tp_and_ddp
    # Its step-10 checkpoint resumes as ddp on 2 (steps 11-20 as ddp's own) and as fsdp on 4.
    checkpoint = resumes_as_ddp(folder, "tp", "dp_shard 2 x tp 2", rel=1e-4)
    four = spec_file(
        folder / "tp-as-fsdp.yaml", 4, "fsdp", steps=12, recipe={**GPT, "source": "probe.py"}
    )
    train(folder, four, "tp-as-fsdp", "--resume", checkpoint)
    assert [r["step"] for r in metrics_of(folder / "tp-as-fsdp") if "loss" in r] == [11, 12]

    # Export writes whole tensors from the 2-D layout: ddp's weights at step 20.
    assert_exports_alike(folder, "tp", "ddp")


def test_hsdp_on_two_nodes_is_one_replica_per_node_matches_ddp_and_resumes_as_fsdp(
    tmp_path: Path,
) -> None:
    ddp = spec_file(tmp_path / "ddp.yaml", 4, "ddp", checkpoint={"enabled": False})
    train(tmp_path, ddp, "ddp")
    # Two "nodes" of 2 processes on loopback; dp_replicate: auto is one replica per node.
    hsdp = spec_file(tmp_path / "hsdp.yaml", 2, "fsdp", parallel={"dp_replicate": "auto"})
    nodes = finish_nodes(start_nodes(hsdp, "hsdp", "--devices", "2")[0], tmp_path, timeout=200)
    for node in nodes:
        assert node.returncode == 0, node.stdout + node.stderr
    assert "fsdp (dp_replicate 2 x dp_shard 2) on 4 x cpu" in nodes[1].stdout
    run_dir = tmp_path / "runs" / "dims" / "hsdp"
    for ours, theirs in zip(curves(run_dir), curves(tmp_path / "ddp"), strict=True):
        assert_close(ours, theirs, rel=1e-5)

    # Its step-10 checkpoint resumes as fsdp on one node of 4: steps 11-20 are ddp's.
    fsdp = spec_file(tmp_path / "fsdp.yaml", 4, "fsdp")
    checkpoint = str(run_dir / "checkpoints" / "step-00000010")
    train(tmp_path, fsdp, "fsdp", "--resume", checkpoint)
    assert_close(curves(tmp_path / "fsdp")[0], curves(tmp_path / "ddp")[0][10:], rel=1e-5)


def test_degrees_resolve_against_the_world_or_are_refused_with_the_numbers() -> None:
    def dims(strategy: str, world: int, per_node: int, **degrees: object) -> ParallelDims:
        return resolve_dims(ParallelSection(**degrees), strategy, world, per_node)

    assert dims("ddp", 4, 4) == ParallelDims(4, 1, 1)
    assert dims("fsdp", 8, 4) == ParallelDims(1, 8, 1)
    assert dims("fsdp", 8, 4, dp_replicate="auto") == ParallelDims(2, 4, 1)
    assert dims("fsdp", 8, 4, dp_replicate="auto", tp=2) == ParallelDims(2, 2, 2)
    assert dims("fsdp", 8, 8, dp_shard=2, tp=2) == ParallelDims(2, 2, 2)
    layout = dims("fsdp", 8, 8, dp_replicate=2, tp=2)
    assert layout == ParallelDims(2, 2, 2) and layout.dp_size == 4
    assert [layout.dp_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    refused = {
        "does not make the 8 processes": dict(strategy="fsdp", world=8, per_node=8, dp_shard=3),
        "tensor-parallel group would span nodes": dict(strategy="fsdp", world=8, per_node=2, tp=4),
        "need launch.strategy: fsdp": dict(strategy="ddp", world=4, per_node=4, tp=2),
        "has no such dimension": dict(strategy="xla_spmd", world=1, per_node=1, tp=2),
    }
    for expected, case in refused.items():
        with pytest.raises(UsageError, match=expected):
            dims(case.pop("strategy"), case.pop("world"), case.pop("per_node"), **case)


def test_a_layout_that_does_not_fit_the_world_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    spec = spec_file(tmp_path / "run.yaml", 4, "fsdp", parallel={"dp_replicate": 3})
    usage_error(train_in_fork(["--config", str(spec)], tmp_path), "parallel: dp_replicate 3")
    assert not (tmp_path / "runs").exists()


def test_a_model_without_a_plan_is_refused_under_tp(tmp_path: Path) -> None:
    spec = {
        "run": {"name": "t", "output_dir": str(tmp_path / "runs")},
        "launch": {"accelerator": "cpu", "devices": 2, "strategy": "fsdp"},
        "recipe": {"source": str(REPO / "recipes" / "mlp.py"), "dataset": {"n_samples": 64}},
        "train": {"max_steps": 2},
        "parallel": {"tp": 2},
    }
    (tmp_path / "run.yaml").write_text(json.dumps(spec))
    result = train_in_fork(["validate", "--config", str(tmp_path / "run.yaml")], tmp_path)
    usage_error(result, "parallel.tp: 2", "parallelize(model, mesh)")


LLAMA = f"""
import importlib.util

import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

_spec = importlib.util.spec_from_file_location("gpt", {str(REPO / "recipes" / "gpt.py")!r})
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)
build_dataset = gpt.build_dataset


def build_model():
    config = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
"""


def test_a_transformers_model_is_split_by_its_own_plan(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "llama.py").write_text(LLAMA)
    llama = {"source": "llama.py", "model": {}, "dataset": GPT["dataset"]}
    checkpoint = {"enabled": False}
    one = spec_file(tmp_path / "one.yaml", 1, "ddp", steps=8, recipe=llama, checkpoint=checkpoint)
    tp = spec_file(
        tmp_path / "tp.yaml", 2, "fsdp", steps=8, recipe=llama, checkpoint=checkpoint,
        parallel={"tp": 2},
    )  # fmt: skip
    train(tmp_path, one, "one")
    split = train(tmp_path, tp, "tp")
    assert "tensor parallel over 2 processes: LlamaForCausalLM's own tp_plan" in split.stdout
    for ours, theirs in zip(curves(tmp_path / "tp"), curves(tmp_path / "one"), strict=True):
        assert_close(ours, theirs, rel=1e-4)

"""Pipeline parallelism (`parallel.pp`): the GPT recipe cut into stages by torch's tracer and
run by torch.distributed.pipelining's schedules, 4 processes on gloo, in fp32 without dropout.
Each layout sees the global batch ddp sees (the stages of one pipeline share a data-parallel
rank), so the losses, gradient norms and exact evaluation means are ddp's; checkpoints are
keyed by the whole model's names, so they resume in other layouts and export whole. Every
refusal comes before any worker starts (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launcher.config.parallel import ParallelSection
from launcher.errors import UsageError
from launcher.parallel.dims import ParallelDims, resolve_dims
from launcher.parallel.pipeline.layout import MIN_TORCH
from tests.conftest import metrics_of, usage_error
from tests.forked_train import train_in_fork
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
OLD_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < MIN_TORCH
needs_new_torch = pytest.mark.skipif(OLD_TORCH, reason="refused there: see the test below")

PIPELINE = {"pp": 2, "pp_microbatches": 2}


@pytest.fixture(scope="module")
def pp_and_ddp(ddp_on_2: Path) -> tuple[Path, str]:
    """pp 2 x dp_shard 2 (1F1B) on 4 processes, 20 steps, beside ddp on 2 (`ddp_on_2`); the
    folder, and the pipeline run's output."""
    pp = spec_file(ddp_on_2 / "pp.yaml", 4, "fsdp", parallel=PIPELINE)
    return ddp_on_2, train(ddp_on_2, pp, "pp").stdout


@pytest.mark.smoke  # torch's pipelining API moves between versions: 2.11 is the GPUs'
@needs_new_torch
def test_a_pipeline_over_sharded_stages_trains_as_ddp(pp_and_ddp: tuple[Path, str]) -> None:
    folder, output = pp_and_ddp
    assert "fsdp (pp 2 x dp_shard 2) on 4 x cpu" in output
    assert "pipeline: 2 stages over pp 2 (1F1B, 2 micro-batches a step)" in output
    # Losses, the clipped gradients' norm (over both stages) and the evaluation mean.
    for ours, theirs in zip(curves(folder / "pp"), curves(folder / "ddp"), strict=True):
        assert_close(ours, theirs, rel=1e-5)


def test_gpipe_trains_as_ddp(pp_and_ddp: tuple[Path, str]) -> None:
    folder, _ = pp_and_ddp
    gpipe = spec_file(
        folder / "gpipe.yaml", 4, "fsdp", parallel={**PIPELINE, "pp_schedule": "GPipe"},
        checkpoint={"enabled": False},
    )  # fmt: skip
    train(folder, gpipe, "gpipe")
    for ours, theirs in zip(curves(folder / "gpipe"), curves(folder / "ddp"), strict=True):
        assert_close(ours, theirs, rel=1e-5)


def test_a_pipeline_checkpoint_resumes_in_other_layouts_and_exports_whole(
    pp_and_ddp: tuple[Path, str],
) -> None:
    folder, _ = pp_and_ddp
    spec_file(folder / "pp-as-ddp.yaml", 2, "ddp")  # ddp on 2, with the recipe pp trained
    checkpoint = resumes_as_ddp(folder, "pp", "pp 2 x dp_shard 2", 1e-5, "pp-as-ddp.yaml")
    # In its own layout, where each process holds only its stage's part of the checkpoint.
    train(folder, folder / "pp.yaml", "pp-as-pp", "--resume", checkpoint)
    assert curves(folder / "pp-as-pp")[0] == curves(folder / "pp")[0][10:]
    # As fsdp on 4 with tensor parallelism in place of the pipeline: 2 data-parallel ranks.
    tp = spec_file(folder / "pp-as-tp.yaml", 4, "fsdp", parallel={"tp": 2})
    train(folder, tp, "pp-as-tp", "--resume", checkpoint)
    assert_close(curves(folder / "pp-as-tp")[0], curves(folder / "ddp")[0][10:], rel=1e-4)

    # Export writes the whole model from the stages: ddp's weights at step 20.
    assert_exports_alike(folder, "pp", "ddp")


def test_a_pipeline_of_tensor_parallel_stages_trains_as_one_process(tmp_path: Path) -> None:
    one = spec_file(tmp_path / "one.yaml", 1, "ddp", checkpoint={"enabled": False})
    train(tmp_path, one, "one")
    both = spec_file(
        tmp_path / "pp-tp.yaml", 4, "fsdp", parallel={**PIPELINE, "tp": 2},
        checkpoint={"enabled": False},
    )  # fmt: skip
    output = train(tmp_path, both, "pp-tp").stdout
    assert "fsdp (pp 2 x tp 2) on 4 x cpu" in output
    for ours, theirs in zip(curves(tmp_path / "pp-tp"), curves(tmp_path / "one"), strict=True):
        assert_close(ours, theirs, rel=1e-4)
    assert [r["step"] for r in metrics_of(tmp_path / "pp-tp") if "loss" in r] == list(range(1, 21))


NO_HOOKS = """
import importlib.util
_spec = importlib.util.spec_from_file_location("gpt", GPT_SOURCE)
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)
build_model, build_dataset, loss = gpt.build_model, gpt.build_dataset, gpt.loss
"""


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["parallel.pp=4"], ["parallel.pp: 4 stages", "the model has 2"]),
        (["parallel.pp_split_points=[blocks.9]"], ["parallel.pp_split_points: blocks.9 names no"]),
        (["parallel.pp_microbatches=3"], ["parallel.pp_microbatches: 3 micro-batches", "4"]),
        (["parallel.pp_schedule=Looped"], ["parallel.pp_schedule"]),
        (
            ["parallel.pp_schedule=ZBVZeroBubble", "recipe.model.n_layer=4"],
            ["ZBVZeroBubble", "2 data-parallel ranks"],
        ),
        (["data.drop_last=false"], ["data.drop_last: false"]),
        (["train.precision=fp16"], ["train.precision: fp16 scales the loss"]),
        (["launch.strategy=ddp"], ["parallel.pp: ddp keeps a whole replica"]),
        (["recipe.source=no_hooks.py"], ["defines no split_batch and no loss_from_output"]),
    ],
    ids=["more-stages-than-blocks", "unknown-split-point", "micro-batches", "schedule",
         "zero-bubble-with-fsdp", "short-last-batch", "fp16", "ddp", "recipe-without-hooks"],
)  # fmt: skip
def test_a_pipeline_it_cannot_run_is_refused_before_any_start(
    tmp_path: Path, overrides: list[str], expected: list[str]
) -> None:
    (tmp_path / "no_hooks.py").write_text(NO_HOOKS.replace("GPT_SOURCE", repr(GPT["source"])))
    spec = spec_file(tmp_path / "run.yaml", 4, "fsdp", parallel=PIPELINE)
    result = train_in_fork(["--config", str(spec), *overrides], tmp_path)
    usage_error(result, *expected)
    assert not (tmp_path / "runs").exists()  # nothing started


@pytest.mark.parametrize("strategy", ["xla", "xla_spmd", "xla_fsdp"])
def test_the_xla_strategies_take_no_pipeline(strategy: str) -> None:
    with pytest.raises(UsageError, match=f"parallel.pp: launch.strategy {strategy} has no such"):
        resolve_dims(ParallelSection(pp=2), strategy, world=4, per_node=4)


def test_a_ranks_place_in_the_grid_gives_its_data_rank() -> None:
    """pp outermost, tp innermost: the stages of one pipeline share a data-parallel rank."""
    dims = ParallelDims(dp_shard=2, tp=2, pp=2)
    assert [dims.dp_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [dims.pp_rank(rank) for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert ParallelDims.from_record(dims.as_record(), 8) == dims
    # A checkpoint from before the layout was recorded kept tp alone.
    assert ParallelDims.from_record(None, 4, tp=2) == ParallelDims(dp_replicate=2, tp=2)


@pytest.mark.smoke
@needs_new_torch
def test_validate_says_where_the_stages_begin_and_the_memory_of_each(tmp_path: Path) -> None:
    spec = spec_file(tmp_path / "run.yaml", 4, "fsdp", parallel=PIPELINE)
    result = train_in_fork(["validate", "--config", str(spec)], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "parallel.pp: 2 stages (1F1B, 2 micro-batches, cut by torch's tracer), beginning at "
        "blocks.1" in result.stdout
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("memory per device")]
    assert [line.split("micro-batch of 2, ")[1].split(")")[0] for line in lines] == [
        "pp rank 0: stage 0 of 2",
        "pp rank 1: stage 1 of 2",
    ], result.stdout


@pytest.mark.smoke
@pytest.mark.skipif(not OLD_TORCH, reason="this torch runs pipelines (the tests above)")
def test_an_older_torch_is_refused_before_any_start(tmp_path: Path) -> None:
    """torch 2.9 (torch_xla's, in make test's XLA suite) hung in its first step's exchange
    between stages."""
    spec = spec_file(tmp_path / "run.yaml", 4, "fsdp", parallel=PIPELINE)
    usage_error(train_in_fork(["--config", str(spec)], tmp_path), "pipelines need torch 2.11")
    assert not (tmp_path / "runs").exists()

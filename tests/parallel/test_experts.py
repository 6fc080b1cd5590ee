"""Expert parallelism (`parallel.ep`) on stock Hugging Face mixtures of experts (Qwen3-MoE,
Mixtral), tiny and randomly initialised, fp32 on gloo, with no recipe change: each process
holds 1/ep of every expert tensor, tokens reach their experts by all-to-all, and the run is
ddp's (losses, the router's auxiliary loss, gradient norms, evaluations); its checkpoints keep
the whole model's names, so they resume bit for bit, resume as ddp, and export for
`from_pretrained`. `train validate` refuses what cannot be spread, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.parallel.dims import ParallelDims
from tests.conftest import (
    REPO,
    metrics_of,
    run_train,
    usage_error,
)
from tests.forked_train import train_in_fork
from tests.parallel.layouts import (
    assert_a_killed_run_resumes_bit_for_bit,
    assert_close,
    assert_hf_export_matches,
    curves,
    spec_file,
    train,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(400)

# The Hugging Face recipe, recording how many experts (rows of a stacked expert tensor) each
# process computes with: its forward, which expert parallelism calls on this process's
# experts alone, as local tensors.
ROWS_RECIPE = f"""
import importlib.util
import sys

sys.path.insert(0, {str(REPO / "recipes")!r})  # the recipe imports its sibling
_spec = importlib.util.spec_from_file_location("hf", {str(REPO / "recipes" / "hf_causal_lm.py")!r})
hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf)
build_dataset = hf.build_dataset
ROWS = []


def build_model(**kwargs):
    model = hf.build_model(**kwargs)
    for module in model.modules():
        if hasattr(module, "gate_up_proj"):
            forward = module.forward

            def recording(*args, _module=module, _forward=forward, **kw):
                ROWS.append(_module.gate_up_proj.shape[0])
                return _forward(*args, **kw)

            module.forward = recording
    return model


def loss(model, batch):
    ROWS.clear()
    value = hf.loss(model, batch)
    return value, {{"expert_rows": float(max(ROWS))}}
"""


def moe_spec(
    folder: Path, name: str, devices: int, strategy: str, family: str, **sections: dict
) -> Path:
    (folder / "moe_recipe.py").write_text(ROWS_RECIPE)
    recipe = {
        "source": str(folder / "moe_recipe.py"),
        "model": {"family": family, "layers": 2, "hidden": 32, "experts": 4, "top_k": 2},
        "dataset": {"seq_len": 16},
    }
    return spec_file(
        folder / f"{name}.yaml", devices, strategy, recipe=recipe,
        optim={"name": "AdamW", "lr": 0.001}, **sections,
    )  # fmt: skip


def figures(run_dir: Path, key: str) -> list[float]:
    return [r[key] for r in metrics_of(run_dir) if key in r]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ddp on 2 and ep 2 on 2 (fsdp), 20 steps, checkpoints and evaluations every 10."""
    folder = tmp_path_factory.mktemp("qwen3_moe")
    train(folder, moe_spec(folder, "ddp", 2, "ddp", "qwen3_moe"), "ddp")
    spec = moe_spec(folder, "ep", 2, "fsdp", "qwen3_moe", parallel={"ep": 2})
    output = train(folder, spec, "ep").stdout
    assert "fsdp (dp_shard 2 x ep 2) on 2 x cpu" in output
    assert "warning: the router" not in output  # a random router loads its experts evenly
    return folder


@pytest.mark.smoke
def test_experts_spread_over_2_processes_train_as_ddp(qwen: Path) -> None:
    for ours, theirs in zip(curves(qwen / "ep"), curves(qwen / "ddp"), strict=True):
        assert_close(ours, theirs, rel=1e-5)  # losses, gradient norms, val losses
    aux = figures(qwen / "ep", "aux_loss")
    assert_close(aux, figures(qwen / "ddp", "aux_loss"), rel=1e-5)
    assert len(aux) == 20 and all(value > 0 for value in aux)
    assert set(figures(qwen / "ddp", "expert_rows")) == {4.0}  # every expert in every process
    assert set(figures(qwen / "ep", "expert_rows")) == {2.0}  # half of them: ep 2
    assert all(1.0 <= value < 2.0 for value in figures(qwen / "ep", "experts/imbalance"))


def test_an_ep_checkpoint_resumes_as_ddp_and_exports_for_from_pretrained(qwen: Path) -> None:
    checkpoint = str(qwen / "ep" / "checkpoints" / "step-00000010")
    train(qwen, qwen / "ddp.yaml", "ep-as-ddp", "--resume", checkpoint)
    resumed, uninterrupted = curves(qwen / "ep-as-ddp"), curves(qwen / "ddp")
    assert_close(resumed[0], uninterrupted[0][10:], rel=1e-5)
    assert_close(resumed[1], uninterrupted[1][10:], rel=1e-5)
    assert_hf_export_matches(qwen, "ep", "ddp", "qwen3_moe")


def test_weights_in_the_hubs_layout_load_into_experts_spread_over_processes(qwen: Path) -> None:
    """`save_pretrained` (`export --hf`) keeps a tensor per expert, as the Hub's files do;
    `load.weights` merges them into the model's stacked experts, as `from_pretrained` does:
    an ep run from that folder starts where a ddp run from the checkpoint itself starts."""
    hub = qwen / "ddp-hub"
    export = train_in_fork(["export", str(qwen / "ddp"), "--hf", str(hub)], qwen)
    assert export.returncode == 0, export.stdout + export.stderr
    first_losses = []
    for name, weights in (("ep-from-hub", hub), ("ddp-from-checkpoint", qwen / "ddp")):
        spec = qwen / ("ep.yaml" if name.startswith("ep") else "ddp.yaml")
        steps = ["train.max_steps=2", "checkpoint.enabled=false", f"load.weights={weights}"]
        output = train(qwen, spec, name, *steps).stdout
        assert "load.weights: loaded 25 tensors (41,440 values)" in output
        first_losses.append(curves(qwen / name)[0][0])
    assert_close(first_losses[:1], first_losses[1:], rel=1e-5)


def test_a_killed_ep_run_resumes_latest_bit_for_bit(qwen: Path) -> None:
    assert_a_killed_run_resumes_bit_for_bit(qwen, "ep")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ddp on 4: the reference of both 4-process layouts."""
    folder = tmp_path_factory.mktemp("mixtral")
    spec = moe_spec(folder, "ddp4", 4, "ddp", "mixtral", checkpoint={"enabled": False})
    train(folder, spec, "ddp4")
    return folder


@pytest.mark.parametrize(
    ("parallel", "layout"),
    [
        ({"ep": 2}, "dp_shard 4 x ep 2"),  # each expert FSDP-sharded over the 2 ranks left
        ({"ep": 2, "dp_replicate": 2, "dp_shard": 2}, "dp_replicate 2 x dp_shard 2 x ep 2"),
    ],
)
def test_mixtral_over_4_processes_trains_as_ddp_on_4(
    mixtral: Path, parallel: dict, layout: str
) -> None:
    """The experts reduced over every data rank: within a replica (FSDP over the ranks left
    to each expert) and across replicas (HSDP), the other weights over all 4."""
    folder, off = mixtral, {"enabled": False}
    name = "ep-" + "-".join(f"{k}{v}" for k, v in parallel.items())
    spec = moe_spec(folder, name, 4, "fsdp", "mixtral", checkpoint=off, parallel=parallel)
    assert f"fsdp ({layout}) on 4 x cpu" in train(folder, spec, name).stdout
    for ours, theirs in zip(curves(folder / name), curves(folder / "ddp4"), strict=True):
        assert_close(ours, theirs, rel=1e-5)
    aux, reference = figures(folder / name, "aux_loss"), figures(folder / "ddp4", "aux_loss")
    assert_close(aux, reference, rel=1e-5)
    assert set(figures(folder / name, "expert_rows")) == {2.0}


def test_a_recipes_own_mixture_of_experts_is_spread_by_its_ep_plan(tmp_path: Path) -> None:
    """recipes/moe.py: no Hugging Face model, transformers' contract (docs)."""
    recipe = {
        "source": str(REPO / "recipes" / "moe.py"),
        "model": {},
        "dataset": {"n_samples": 512},
    }
    off = {"enabled": False}
    for name, strategy, parallel in (("ddp", "ddp", {}), ("ep", "fsdp", {"ep": 2})):
        spec = spec_file(
            tmp_path / f"{name}.yaml", 2, strategy, recipe=recipe, checkpoint=off,
            parallel=parallel, optim={"name": "AdamW", "lr": 0.003},
        )  # fmt: skip
        train(tmp_path, spec, name)
    for ours, theirs in zip(curves(tmp_path / "ep"), curves(tmp_path / "ddp"), strict=True):
        assert_close(ours, theirs, rel=1e-5)


# train validate: what cannot be spread, refused before anything starts (exit 2, one line).


@pytest.mark.parametrize(
    ("devices", "strategy", "family", "parallel", "expected"),
    [
        (3, "fsdp", "qwen3_moe", {"ep": 3},
         ["parallel.ep: 3 does not divide Qwen3MoeForCausalLM's 4 experts per layer"]),
        (3, "fsdp", "qwen3_moe", {"ep": 2},
         ["parallel.ep: 2 does not divide the 3 data-parallel ranks of a replica"]),
        (4, "fsdp", "qwen3_moe", {"ep": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 1}, None),
        (2, "ddp", "qwen3_moe", {"ep": 2},
         ["parallel.ep: 2, but ddp keeps every expert in every process", "launch.strategy: fsdp"]),
        (2, "fsdp", "llama", {"ep": 2}, ["parallel.ep: 2, but LlamaForCausalLM has no experts"]),
        (1, "xla", "qwen3_moe", {"ep": 2},
         ["parallel.ep: launch.strategy xla has no such dimension"]),
        (4, "fsdp", "qwen3_moe", {"ep": 2, "pp": 2},
         ["parallel.ep: experts spread over processes do not yet combine with parallel.pp"]),
    ],
)  # fmt: skip
def test_validate_refuses_what_cannot_be_spread(
    tmp_path: Path, devices: int, strategy: str, family: str, parallel: dict, expected: list | None
) -> None:
    tpu = {"accelerator": "tpu"} if strategy.startswith("xla") else {}
    spec = moe_spec(tmp_path, "run", devices, strategy, family, parallel=parallel, launch=tpu)
    result = run_train(["validate", "--config", str(spec)], tmp_path)
    if expected is None:  # HSDP: each replica's dp_shard ranks lend themselves to the experts
        assert result.returncode == 0, result.stdout + result.stderr
        assert "2 in each process (parallel.ep 2)" in result.stdout
        return
    usage_error(result, *expected)


def test_validate_shows_the_experts_share_and_what_each_process_gathers(tmp_path: Path) -> None:
    spec = moe_spec(tmp_path, "run", 2, "fsdp", "qwen3_moe", parallel={"ep": 2})
    result = run_train(["validate", "--config", str(spec)], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "experts 59% of the parameters, 4 per layer: 2 in each process (parallel.ep 2)" in (
        result.stdout
    )
    assert "gathers 24.0 KiB of a layer's 48.0 KiB of expert weights" in result.stdout


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_a_hugging_face_moe_names_its_experts_in_its_own_plan(family: str) -> None:
    import importlib.util
    import sys

    from launcher.parallel.experts import expert_plan
    from launcher.parallel.sharded_init import build_on_meta

    sys.path.insert(0, str(REPO / "recipes"))
    spec = importlib.util.spec_from_file_location("hf_moe", REPO / "recipes" / "hf_causal_lm.py")
    recipe = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(recipe)  # type: ignore[union-attr]
    model = build_on_meta(lambda: recipe.build_model(family=family, layers=3, experts=8))
    plan = expert_plan(model)
    assert plan is not None and plan.experts == 8
    assert plan.modules == [f"model.layers.{i}.mlp.experts" for i in range(3)]
    assert len(plan.parameters()) == 6  # each layer's gate_up_proj and down_proj


def test_the_layout_with_experts_is_recorded_and_read_back() -> None:
    dims = ParallelDims(dp_shard=4, ep=2)
    assert dims.describe() == "dp_shard 4 x ep 2"
    assert ParallelDims.from_record(dims.as_record(), 4) == dims
    assert ParallelDims.from_record({"dp_shard": 4}, 4) == ParallelDims(dp_shard=4)  # older

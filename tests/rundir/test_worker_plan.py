"""One channel from the launcher to its workers: the elastic agent's configuration comes from
the plan alone (a pure step, like torchrun's `config_from_args`), a worker's argv is
`--plan FILE`, and the plan and spec.yaml say the same resolved values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from launcher.clusters.nodes import Nodes
from launcher.config.spec import RunSpec
from launcher.launch.agent import agent_config
from launcher.launch.plan import make_plan
from launcher.launch.run_folder import prepare_run_dir
from launcher.rundir.layout import RunLayout
from launcher.rundir.worker_plan import WorkerPlan
from tests.conftest import REPO, only_run_dir, run_train, write_spec


def _spec(tmp_path: Path, **launch: object) -> RunSpec:
    return RunSpec.model_validate(
        {
            "run": {"name": "exp", "output_dir": str(tmp_path / "runs")},
            "launch": {"accelerator": "auto", "devices": "auto", **launch},
            "recipe": {"source": "r.py"},
            "train": {"max_steps": 1},
        }
    )


def test_the_agent_starts_the_worker_module_with_the_plan_file_alone(tmp_path: Path) -> None:
    plan = make_plan(_spec(tmp_path, devices=2, max_restarts=3))
    config, argv = agent_config(plan, on_round=lambda round: None)
    assert argv == [
        "-u",
        "-m",
        "launcher.worker.main",
        "--plan",
        str(plan.run_dir / "worker-plan.json"),
    ]
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 1, 2)
    assert config.max_restarts == 3
    # One machine: the rendezvous on loopback, on a port the OS picks.
    assert config.rdzv_endpoint == "127.0.0.1:0" and config.local_addr == "127.0.0.1"
    assert config.run_id.startswith("exp-")


def test_each_node_of_a_job_has_its_own_plan_file(tmp_path: Path) -> None:
    nodes = Nodes(min=2, max=2, node_rank=1, endpoint="node0:29500", job_id="job7")
    plan = make_plan(_spec(tmp_path, devices=1), nodes=nodes)
    config, argv = agent_config(plan, on_round=lambda round: None)
    assert argv[-1] == str(plan.run_dir / "nodes" / "node-1" / "worker-plan.json")
    assert config.run_id == "job7" and config.rdzv_endpoint == "node0:29500"
    assert config.local_addr is None  # the other nodes reach node 0 at its own address


def test_the_plan_file_round_trips_with_nothing_left_auto(tmp_path: Path) -> None:
    plan = make_plan(_spec(tmp_path))
    prepare_run_dir(plan)
    read = WorkerPlan.read(RunLayout.worker_plan(plan.node_dir))
    assert read == plan.worker_plan()
    assert read.accelerator == read.run_spec().launch.accelerator == "cpu"
    assert read.run_spec().launch.devices == 1 and read.resume_from is None
    spec_yaml = yaml.safe_load(RunLayout(plan.run_dir).spec.read_text())
    assert spec_yaml["launch"]["accelerator"] == "cpu" and spec_yaml["launch"]["devices"] == 1


@pytest.mark.timeout(180)
def test_a_run_with_auto_values_records_what_it_resolved_them_to(tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path / "run.yaml",
        launch={"accelerator": "auto", "devices": "auto"},
        train={"max_steps": 2, "log_every": 1},
    )
    result = run_train(["--config", str(spec)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run_dir(tmp_path / "runs")
    saved = yaml.safe_load((run / "spec.yaml").read_text())
    told = json.loads((run / "worker-plan.json").read_text())
    assert saved["launch"]["accelerator"] == told["accelerator"] == "cpu"
    assert saved["launch"] == told["spec"]["launch"]


CHDIR_RECIPE = """
import os
from recipes_mlp import build_dataset, build_model as mlp, loss  # noqa: F401


def build_model():
    os.makedirs("elsewhere", exist_ok=True)
    os.chdir("elsewhere")  # research code does this
    return mlp()
"""


@pytest.mark.timeout(240)
def test_a_recipe_that_changes_its_working_directory_trains_on(tmp_path: Path) -> None:
    """The paths a worker gets are absolute: the run folder given relative to the launch
    folder is still found after the recipe's os.chdir()."""
    (tmp_path / "recipes_mlp.py").write_text((REPO / "recipes" / "mlp.py").read_text())
    (tmp_path / "wanders.py").write_text(CHDIR_RECIPE)
    spec = write_spec(
        tmp_path / "run.yaml",
        run={"name": "t", "output_dir": "runs"},
        recipe={"source": "wanders.py", "dataset": {"n_samples": 512}},
        train={"max_steps": 4},
        checkpoint={"every_n_steps": 2},
    )
    result = run_train(["--config", str(spec)], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run_dir(tmp_path / "runs")
    assert (run / "checkpoints" / "step-00000004" / "COMPLETE").is_file()
    plan = json.loads(RunLayout.worker_plan(run).read_text())
    assert Path(plan["run_dir"]).is_absolute()

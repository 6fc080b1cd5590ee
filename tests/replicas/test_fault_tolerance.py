"""`fault_tolerance`: replica groups on torchft, for real: a Lighthouse, one elastic agent per
group, gloo on loopback, and a recipe that SIGKILLs one process of group 1 once."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from launcher.rundir import fault_events
from launcher.rundir.layout import RunLayout
from tests.conftest import (
    finish_train,
    only_run_dir,
    run_train,
    usage_error,
    write_spec,
)
from tests.forked_train import fork_train
from tests.tiny_recipes import recipe_text, tiny_recipe, write_recipe

pytest.importorskip("torchft")
pytestmark = pytest.mark.timeout(240)

# Group 1's rank 0 kills itself in its first attempt's micro-step KILL_AT (every attempt's,
# with ALWAYS); with PAUSE it
# first sleeps, so that the other group is surely waiting inside the step's all-reduce.
KILLER = """
import os, signal, time

calls = 0


def loss(model, batch):
    global calls
    calls += 1
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" or "ALWAYS" in os.environ
    victim = os.environ["REPLICA_GROUP_ID"] == "1" and os.environ["RANK"] == "0"
    if first and victim and calls == int(os.environ.get("KILL_AT", "30")):
        time.sleep(float(os.environ.get("PAUSE", "0")))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.04)  # group 0 still trains when group 1 is back (a 3-8 s restart)
    return tiny.loss(model, batch)
"""


def _spec(
    tmp_path: Path,
    strategy: str,
    devices: int,
    steps: int = 150,
    restarts: int = 2,
    **sections: dict,
) -> Path:
    recipe = write_recipe(tmp_path, KILLER)
    return write_spec(
        tmp_path / "ft.yaml",
        launch={"strategy": strategy, "devices": devices, "max_restarts": restarts},
        recipe=tiny_recipe(recipe, model={"hidden": 8}, n_samples=4096),
        train={"max_steps": steps, "log_every": 10},
        checkpoint={"every_n_steps": 20},
        fault_tolerance={"enabled": True, "replica_groups": 2, "heartbeat_timeout_ms": 1000},
        **sections,
    )


@pytest.mark.parametrize(("strategy", "devices"), [("ddp", 2), ("fsdp", 4)])
def test_a_killed_group_heals_from_a_live_one_and_the_groups_end_alike(
    tmp_path: Path, strategy: str, devices: int
) -> None:
    result = run_train(["--config", str(_spec(tmp_path, strategy, devices))], tmp_path, 200)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    run_dir = only_run_dir(tmp_path / "runs")
    events = fault_events.read(RunLayout(run_dir).fault_events)
    assert "replica group 1 (ranks" in output and "lost: restarting it" in output
    losses = fault_events.summarize(events)
    assert [loss["group"] for loss in losses] == [1], events
    loss = losses[0]
    # Group 0 stepped on (without group 1, unless it was back first: a loaded machine), and
    # group 1 came back, healed from memory.
    assert loss["next_step_after_s"] is not None, events
    assert loss["steps_with_fewer_groups"] is not None, events
    if loss["steps_with_fewer_groups"]:  # the live display said so
        assert "1 of 2 replica groups train" in output and "2 of 2 replica groups train" in output
    assert loss["heal_s"] is not None and not loss["gave_up"], events
    healed = run_dir / "logs" / f"rank-{devices // 2}.log"
    log = healed.read_text()
    assert "copying the state of a live replica group" in log
    assert "resuming from" not in log  # no checkpoint read
    # Both groups trained to the end, with the same parameters, rank by rank.
    finished = [e for e in events if e["event"] == "finished"]
    assert {(e["group"], e["step"]) for e in finished} == {(0, 150), (1, 150)}, finished
    assert fault_events.groups_agree(events) is True, finished
    outcome = json.loads((run_dir / "outcome.json").read_text())
    assert outcome["status"] == "finished"
    assert outcome["replica_group_losses"][0]["group"] == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["fault_tolerance"]["losses"][0]["group"] == 1
    listed = run_train(["runs", "--output-dir", str(tmp_path / "runs"), "--json"], tmp_path)
    assert json.loads(listed.stdout)[0]["groups_lost"] == 1, listed.stdout


def test_a_group_lost_inside_the_all_reduce_voids_the_step_and_the_other_goes_on(
    tmp_path: Path,
) -> None:
    spec = _spec(tmp_path, "ddp", 2, steps=40)
    result = run_train(["--config", str(spec)], tmp_path, 200, env={"PAUSE": "0.5"})
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = only_run_dir(tmp_path / "runs")
    survivor = (run_dir / "logs" / "rank-0.log").read_text()
    assert "step 30 is void" in survivor and "taking it again" in survivor
    events = fault_events.read(RunLayout(run_dir).fault_events)
    assert fault_events.groups_agree(events) is True


def test_a_group_that_keeps_failing_is_left_out_and_the_others_finish(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "ddp", 2, restarts=1)
    result = run_train(["--config", str(spec)], tmp_path, 200, env={"ALWAYS": "1", "KILL_AT": "3"})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "replica group 1 failed 2 times (launch.max_restarts): the other groups go on" in output
    run_dir = only_run_dir(tmp_path / "runs")
    events = fault_events.read(RunLayout(run_dir).fault_events)
    assert [e["group"] for e in events if e["event"] == "finished"] == [0], events
    outcome = json.loads((run_dir / "outcome.json").read_text())
    assert outcome["status"] == "finished" and outcome["replica_group_losses"][-1]["gave_up"]


def test_a_lost_lighthouse_stops_the_run_with_its_checkpoints_intact(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "ddp", 2, steps=5000)
    proc = fork_train(["--config", str(spec)], tmp_path, env={"KILL_AT": "0"})
    run_dir = _wait_for_checkpoint(tmp_path / "runs", proc)
    (lighthouse,) = [
        p for p in psutil.Process(proc.pid).children(recursive=True)
        if "launcher.replicas.lighthouse" in " ".join(p.cmdline())
    ]  # fmt: skip
    lighthouse.kill()
    result = finish_train(proc, tmp_path, 120)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "error: the fault-tolerance Lighthouse (killed by SIGKILL) is gone" in output
    assert "checkpoints are intact (newest: step-" in output and "Traceback" not in output
    from launcher.checkpoint.catalog import latest_complete

    assert latest_complete(run_dir) is not None
    outcome = json.loads((run_dir / "outcome.json").read_text())
    assert outcome["status"] == "failed"
    assert outcome["reason"].startswith("the fault-tolerance Lighthouse")


def _wait_for_checkpoint(runs: Path, proc: object) -> Path:
    from launcher.checkpoint.catalog import latest_complete

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()  # type: ignore[attr-defined]
        found = [p for p in runs.glob("*/*") if p.is_dir() and latest_complete(p)]
        if found:
            return found[0]
        time.sleep(0.1)
    pytest.fail("no checkpoint was saved")


def test_fault_tolerance_is_refused_where_it_cannot_run(tmp_path: Path) -> None:
    uneven = _spec(tmp_path, "ddp", 3)
    usage_error(
        run_train(["--config", str(uneven)], tmp_path),
        "fault_tolerance.replica_groups: 2 groups cannot share 3 processes evenly",
    )
    assert not (tmp_path / "runs").exists()
    no_rank = ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "j"]
    usage_error(
        run_train(["--config", str(_spec(tmp_path, "ddp", 2)), *no_rank], tmp_path),
        "fault_tolerance: on several machines every node needs a fixed --nnodes and its "
        "--node-rank",
    )
    xla = _spec(tmp_path, "xla", 1)
    usage_error(
        run_train(["validate", "--config", str(xla)], tmp_path),
        "fault_tolerance: not for launch.strategy xla",
    )


def test_settings_that_would_fail_after_minutes_are_refused_before_launch(tmp_path: Path) -> None:
    """Each used to fail after minutes of retries (2 to 3), or after the run folder existed."""
    from http.server import HTTPServer, SimpleHTTPRequestHandler

    from tests.conftest import free_port

    spec = _spec(tmp_path, "ddp", 2)
    cases = [
        (["fault_tolerance.min_replicas=5"], "fault_tolerance.min_replicas: 5, but the run has 2"),
        (["fault_tolerance.lighthouse=127.0.0.1:1"], "127.0.0.1:1: nothing answers there"),
        (["fault_tolerance.heartbeat_timeout_ms=100000000000000"], "heartbeat_timeout_ms"),
    ]
    for overrides, said in cases:
        usage_error(run_train(["--config", str(spec), *overrides], tmp_path), said)
    other = HTTPServer(("127.0.0.1", 0), SimpleHTTPRequestHandler)  # a web server of another kind
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        at = f"fault_tolerance.lighthouse=127.0.0.1:{other.server_address[1]}"
        usage_error(run_train(["--config", str(spec), at], tmp_path), "not a torchft Lighthouse")
    finally:
        other.shutdown()
    with socket.socket() as taken:  # node 0 starts the Lighthouse on a port someone holds
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        nodes = ["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
        result = run_train(
            [
                "--config",
                str(spec),
                *nodes,
                "--rdzv-id",
                "j",
                f"fault_tolerance.lighthouse_port={port}",
            ],
            tmp_path,
        )
        usage_error(result, f"fault_tolerance.lighthouse_port {port}: taken on 127.0.0.1")
    assert not (tmp_path / "runs").exists()
    no_restarts = run_train(
        ["validate", "--config", str(spec), "launch.max_restarts=0"],
        tmp_path,
        env={"REPLICA_GROUP_ID": "0"},  # the recipe reads it
    )
    assert no_restarts.returncode == 0, no_restarts.stdout + no_restarts.stderr
    assert "warning: fault_tolerance with launch.max_restarts 0" in no_restarts.stderr


def test_a_missing_torchft_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from launcher.config.fault_tolerance import require_torchft
    from launcher.errors import UsageError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name)
    )
    with pytest.raises(UsageError) as caught:
        require_torchft()
    assert "launcher[ft]" in caught.value.render()


def test_a_resume_from_disk_is_exact(tmp_path: Path) -> None:
    """Random streams come from (seed, rank, step): a run resumed from its checkpoint ends
    where the uninterrupted run does (the recipe's dropout draws on every step)."""
    dropout = "\n\ndef build_model(**kw):\n    import torch\n\n    return torch.nn.Sequential(tiny.build_model(**kw), torch.nn.Dropout(0.5))\n"
    ends = []
    for name, legs in (("whole", ["train.max_steps=40"]), ("resumed", ["train.max_steps=20"])):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "recipe.py").write_text(recipe_text(KILLER + dropout))
        spec = write_spec(
            folder / "ft.yaml",
            launch={"strategy": "ddp", "devices": 2},
            recipe=tiny_recipe(folder / "recipe.py", n_samples=4096),
            checkpoint={"every_n_steps": 10},
            fault_tolerance={"enabled": True, "replica_groups": 2},
        )
        steps = (
            [legs, ["--resume", "latest", "train.max_steps=40"]] if name == "resumed" else [legs]
        )
        for args in steps:
            result = run_train(["--config", str(spec), *args], folder, 200, env={"KILL_AT": "0"})
            assert result.returncode == 0, result.stdout + result.stderr
        events = fault_events.read(RunLayout(only_run_dir(folder / "runs")).fault_events)
        ends.append(
            {(e["group"], e["step"], e["digest"]) for e in events if e["event"] == "finished"}
        )
    assert ends[0] == ends[1] and len(ends[0]) == 2, ends


def test_two_nodes_each_a_group_heal_across_machines(tmp_path: Path) -> None:
    """`--nnodes 2`: each node runs one group under its own agent; node 0 starts the
    Lighthouse at the rendezvous host. Node 1's group is lost and heals from node 0's."""
    from tests.conftest import free_port
    from tests.launch.test_multinode import finish_nodes

    spec = _spec(tmp_path, "ddp", 1)
    ft = yaml.safe_load(spec.read_text())
    ft["fault_tolerance"] |= {"replica_groups": 1, "lighthouse_port": free_port()}
    spec.write_text(yaml.safe_dump(ft))
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        fork_train(
            ["--config", str(spec), "--nnodes", "2", "--node-rank", str(rank),
             "--rdzv-endpoint", endpoint, "--rdzv-id", "job"],
            tmp_path,
        )
        for rank in (0, 1)
    ]  # fmt: skip
    results = finish_nodes(nodes, tmp_path, 200)
    for result in results:
        assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "t" / "job"  # the nodes share it: the job names it
    events = fault_events.read(RunLayout(run_dir).fault_events)
    assert [loss["group"] for loss in fault_events.summarize(events)] == [1], events
    assert any(e["event"] == "healed" and e["group"] == 1 for e in events), events
    assert fault_events.groups_agree(events) is True, events
    assert "replica groups 1 of 2 here" in results[1].stdout + results[1].stderr


def test_metrics_and_evaluations_are_the_runs_not_a_groups_share(tmp_path: Path) -> None:
    """Each group trains and evaluates its share; what is logged is reduced across the groups
    too (the mean of each group's own loss), and said once, by the group leading the quorum,
    not once per group."""
    spec = _spec(tmp_path, "ddp", 2, steps=20, eval={"every_n_steps": 10, "max_batches": 4})
    result = run_train(["--config", str(spec)], tmp_path, 200, env={"KILL_AT": "0"})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    run_dir = only_run_dir(tmp_path / "runs")
    said = [
        [line for line in (run_dir / "logs" / f"rank-{rank}.log").read_text().splitlines()]
        for rank in (0, 1)
    ]
    # "eval at step 10 | val/loss 1.024 | 0.17 s", and every step line, once in the run.
    assert len([line for line in said[0] if line.startswith("eval at step")]) == 2, said
    assert len([line for line in said[0] if line.startswith("step ")]) == 2, said
    assert not [line for line in said[1] if line.startswith(("step ", "eval at step"))], said
    assert len(re.findall(r"\] step 10/20 ", output)) == 1, output
    # Each group's rank 0 records its own loss; the run's is their mean.
    own = [
        {
            r["step"]: r["loss"]
            for r in map(json.loads, (run_dir / "telemetry" / f"rank-{rank}.jsonl").open())
            if "loss" in r
        }
        for rank in (0, 1)
    ]
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    for record in (r for r in logged if "loss" in r):
        step = record["step"]
        assert record["loss"] == pytest.approx((own[0][step] + own[1][step]) / 2), (record, own)
    assert own[0][20] != pytest.approx(own[1][20])  # the groups' shares differ


@pytest.mark.parametrize(
    ("after", "fewer"),
    [
        # group 0 steps alone from step 30, group 1 is back (healed) at step 40
        ([("quorum", 0, 30, 1), ("healed", 1, 40, 0), ("quorum", 0, 40, 2)], 10),
        # group 1 is back before group 0's next step: no step without it
        ([("healed", 1, 30, 0), ("quorum", 0, 30, 2)], 0),
        # group 1 never comes back
        ([("quorum", 0, 30, 1), ("gave_up", 1, 0, 0)], None),
    ],
)
def test_a_loss_is_summed_up_from_its_events(after: list, fewer: int | None) -> None:
    events = [{"event": "lost", "time": 100.0, "group": 1}]
    for i, (event, group, step, groups) in enumerate(after):
        at = 101.0 + i
        events.append({"event": event, "time": at, "group": group, "step": step,
                       "groups": groups, "of": 2, "heal_s": 0.1})  # fmt: skip
    (loss,) = fault_events.summarize(events)
    assert loss["steps_with_fewer_groups"] == fewer
    assert loss["next_step_after_s"] == (1.0 if after[0][1] == 0 else 2.0)
    assert loss["gave_up"] is (fewer is None)
    assert (loss["back_after_s"] is None) is (fewer is None)


def test_a_group_lost_before_the_first_quorum_is_summed_up_apart_from_its_next_loss() -> None:
    def event(name: str, at: float, group: int, step: int = 0, groups: int = 2) -> dict:
        return {"event": name, "time": at, "group": group, "step": step, "groups": groups,
                "of": 2, "heal_s": 0.5}  # fmt: skip

    events = [
        event("lost", 100.0, 1),  # before any quorum: back in the first one, nothing to copy
        event("quorum", 101.0, 0, step=0),
        event("lost", 199.0, 1),
        event("quorum", 200.0, 0, step=300, groups=1),
        event("healed", 210.0, 1, step=321),
        event("quorum", 211.0, 0, step=321),
    ]
    first, second = fault_events.summarize(events)
    assert (first["steps_with_fewer_groups"], first["heal_s"], first["back_after_s"]) == (
        0,
        None,
        1.0,
    )
    assert (second["steps_with_fewer_groups"], second["heal_s"], second["back_after_s"]) == (
        21,
        0.5,
        11.0,
    )
    summary = fault_events.summary(events)
    assert summary["steps_with_fewer_groups"] == 21  # the sum of its list's
    assert summary["heals"] == [{"group": 1, "step": 321, "heal_s": 0.5}]


def test_a_void_steps_reason_is_cut_at_a_word() -> None:
    from launcher.replicas.torchft_engine import first_words

    gloo = (
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] Read error "
        "[127.0.0.1]:41118: Connection reset by peer while waiting for the other side to finish "
        "its collective operation\nsecond line"
    )
    said = first_words(gloo)
    assert said.endswith("to finish ...") and len(said) <= 164
    assert first_words("timed out\ndetails") == "timed out"


def test_each_process_writes_its_own_events_and_the_reader_merges_them(tmp_path: Path) -> None:
    """No events file has two writers at once: each launcher and each process has its own,
    in the run folder's events folder, read back as one list in time order."""
    folder = RunLayout(tmp_path).fault_events
    launcher, rank_2 = RunLayout.launcher_events(folder, 0), RunLayout.rank_events(folder, 2)
    fault_events.record(rank_2, "quorum", group=1, step=3, groups=2, of=2)
    time.sleep(0.002)  # times are kept to the millisecond
    fault_events.record(launcher, "lost", group=1)
    time.sleep(0.002)
    fault_events.record(rank_2, "healed", group=1, step=9, heal_s=0.1)
    follow = fault_events.NewEvents(folder)
    assert [e["event"] for e in follow()] == ["quorum", "lost", "healed"]
    assert follow() == []
    with open(launcher, "a") as torn:  # a line still being written waits
        torn.write('{"event": "gave_up"')
    assert follow() == [] and [e["event"] for e in fault_events.read(folder)][-1] == "healed"
    # A new attempt: this launcher's own files go, another node's stay; node 0 also removes
    # those of writers the run no longer has.
    other_node, gone = RunLayout.launcher_events(folder, 1), RunLayout.rank_events(folder, 9)
    fault_events.record(other_node, "lost", group=3)
    fault_events.record(gone, "quorum", group=4, step=1, groups=1, of=5)
    fault_events.start_over(folder, [launcher, rank_2])
    assert {p.name for p in folder.iterdir()} == {other_node.name, gone.name}
    fault_events.start_over(folder, [launcher, rank_2], others=[other_node])
    assert [p.name for p in folder.iterdir()] == [other_node.name]
    assert fault_events.kept(folder) and not fault_events.kept(tmp_path / "none")


def test_a_run_of_an_earlier_version_keeps_its_one_events_file(tmp_path: Path) -> None:
    """`train runs` still counts the losses of a run that wrote fault-tolerance.jsonl."""
    layout = RunLayout(tmp_path)
    fault_events.record(tmp_path / "fault-tolerance.jsonl", "lost", group=1)
    assert fault_events.kept(layout.fault_events)
    assert [e["event"] for e in fault_events.read(layout.fault_events)] == ["lost"]

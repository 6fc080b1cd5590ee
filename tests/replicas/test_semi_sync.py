"""`fault_tolerance.sync`: replica groups that train apart and sync every few steps (LocalSGD,
DiLoCo), for real: torchft's Lighthouse and Managers, gloo on loopback, the GPT recipe with
dropout, 2 groups. The runs a test compares are made once per module."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from launcher.rundir import fault_events
from launcher.rundir.layout import RunLayout
from tests.conftest import REPO, run_train, usage_error, write_spec
from tests.parallel.layouts import export_plain

pytest.importorskip("torchft")
pytestmark = pytest.mark.timeout(300)

GPT = REPO / "recipes" / "gpt.py"

# The GPT recipe, whose group 1 rank 0 SIGKILLs itself at its micro-step KILL_AT (first
# attempt only); each step sleeps a little, so that group 0 still trains when group 1 is back.
KILLER = f"""
import importlib.util, os, signal, time

_spec = importlib.util.spec_from_file_location("gpt", {str(GPT)!r})
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)
build_model, build_dataset = gpt.build_model, gpt.build_dataset
calls = 0


def loss(model, batch):
    global calls
    calls += 1
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    victim = os.environ.get("REPLICA_GROUP_ID") == "1" and os.environ.get("RANK") == "0"
    if first and victim and calls == int(os.environ.get("KILL_AT", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
    return gpt.loss(model, batch)
"""

SGD = {"name": "SGD", "lr": 0.1}


def _spec(
    folder: Path, name: str, sync: dict[str, Any], steps: int = 20, layers: int = 1,
    **sections: dict,
) -> Path:  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "recipe.py").write_text(KILLER)
    return write_spec(
        folder / f"{name}.yaml",
        {
            "launch": {"strategy": "ddp", "devices": 2, "max_restarts": 2},
            "recipe": {
                "source": str(folder / "recipe.py"),
                "model": {"n_layer": layers, "n_head": 2, "n_embd": 16, "block_size": 16,
                          "dropout": 0.1},
                "dataset": {"block_size": 16, "max_bytes": 20_000},
            },
            "train": {"max_steps": steps, "log_every": 5, "grad_clip_norm": None},
            "checkpoint": {"every_n_steps": 10},
            "fault_tolerance": {"enabled": True, "replica_groups": 2, "sync": sync},
        },
        run={"name": name},
        **sections,
    )  # fmt: skip


def _train(folder: Path, spec: Path, *args: str, env: dict[str, str] | None = None) -> Path:
    result = run_train(["--config", str(spec), *args], folder, 200, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = (folder / "runs" / spec.stem).iterdir()  # run.name is the spec's name
    return run_dir


def _events(run_dir: Path) -> list[dict[str, Any]]:
    return fault_events.read(RunLayout(run_dir).fault_events)


def _summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())["fault_tolerance"]


@functools.cache
def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The run's last checkpoint's weights, exported once (`train export`)."""
    return export_plain(run_dir.parent.parent.parent, str(run_dir))


def _assert_close(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """10 steps of plain SGD in each group: synced every step; LocalSGD every 1 and every 5;
    DiLoCo every 5 whose outer optimizer is SGD at lr 1 (LocalSGD's average)."""
    folder = tmp_path_factory.mktemp("sync")
    syncs = {
        "every_step": {"method": "every_step"},
        "local_sgd_1": {"method": "local_sgd", "every": 1},
        "local_sgd_5": {"method": "local_sgd", "every": 5},
        "diloco_lr1_5": {"method": "diloco", "every": 5, "outer_optim": {"name": "SGD", "lr": 1.0}},
    }  # fmt: skip
    return {
        name: _train(folder, _spec(folder, name, sync, steps=10, optim=SGD))
        for name, sync in syncs.items()
    }


@pytest.mark.smoke
def test_local_sgd_every_step_is_per_step_syncing_and_diloco_at_lr_1_is_local_sgd(
    runs: dict[str, Path],
) -> None:
    _assert_close(_weights(runs["local_sgd_1"]), _weights(runs["every_step"]))
    _assert_close(_weights(runs["diloco_lr1_5"]), _weights(runs["local_sgd_5"]))
    # LocalSGD every 5 is not per-step syncing: the comparison can tell them apart.
    ours, theirs = _weights(runs["local_sgd_5"]), _weights(runs["every_step"])
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) > 1e-4


def test_diloco_groups_agree_after_each_sync_and_send_a_tenth_of_the_bytes(
    tmp_path: Path, runs: dict[str, Path]
) -> None:
    sync = {"method": "diloco", "every": 10}
    run_dir = _train(tmp_path, _spec(tmp_path, "diloco", sync, steps=40))
    syncs = [e for e in _events(run_dir) if e["event"] == "sync"]
    by_step: dict[int, set[str]] = {}
    for event in syncs:
        by_step.setdefault(event["step"], set()).add(event["digest"])
    assert sorted(by_step) == [10, 20, 30, 40], syncs
    assert all(len(digests) == 1 for digests in by_step.values()), by_step  # one model
    assert len({d for ds in by_step.values() for d in ds}) == 4  # which moves between syncs
    sent = [_summary(r)["sent_to_other_groups"] for r in (run_dir, runs["every_step"])]
    assert 0.09 < sent[0]["per_step"] / sent[1]["per_step"] < 0.11, sent
    said = _summary(run_dir)["sync"]
    assert {k: said[k] for k in ("method", "every", "syncs")} == {
        "method": "diloco", "every": 10, "syncs": 4,
    }  # fmt: skip
    assert 0.89 < said["bytes_saved"] < 0.91, said
    # The metrics: every record's bytes per step; a sync's record, each group's loss.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    synced = [r["step"] for r in records if "sync/loss/group0" in r and "sync/loss/group1" in r]
    assert synced == [10, 20, 30, 40], records
    assert all("groups/bytes_per_step" in r for r in records if "loss" in r), records
    listed = run_train(["runs", "--output-dir", str(tmp_path / "runs"), "--json"], tmp_path)
    assert json.loads(listed.stdout)[0]["sync"]["method"] == "diloco", listed.stdout
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert "sync after step 10: 2 of 2 replica groups" in log


def test_a_group_killed_mid_round_heals_from_the_survivor_and_the_groups_end_alike(
    tmp_path: Path,
) -> None:
    sync = {"method": "diloco", "every": 10}
    spec = _spec(tmp_path, "killed", sync, steps=120)
    run_dir = _train(tmp_path, spec, env={"KILL_AT": "15", "STEP_SLEEP": "0.04"})
    events = _events(run_dir)
    assert [loss["group"] for loss in fault_events.summarize(events)] == [1], events
    assert any(e["event"] == "healed" and e["group"] == 1 for e in events), events
    finished = [e for e in events if e["event"] == "finished"]
    assert {(e["group"], e["step"]) for e in finished} == {(0, 120), (1, 120)}, finished
    assert fault_events.groups_agree(events) is True, finished
    healed = (run_dir / "logs" / "rank-1.log").read_text()
    assert "copying the state of a live replica group" in healed


def test_fsdp_groups_resume_from_a_sync_bit_for_bit_and_train_as_ddp_groups(
    tmp_path: Path,
) -> None:
    """2 groups of 2 processes: fsdp inside each group (the outer state sharded, in memory
    and in checkpoints) trains as ddp inside each does, each process sending half the
    bytes; stopped at a sync (step 20) and resumed to 40, it ends bit for bit where the run
    that never stopped does."""
    sync = {"method": "diloco", "every": 10}
    four = {"launch": {"strategy": "fsdp", "devices": 4, "max_restarts": 0}}
    runs, ends = {}, []
    for name, legs in (("whole", [["train.max_steps=40"]]),
                       ("resumed", [["train.max_steps=20"],
                                    ["--resume", "latest", "train.max_steps=40"]])):  # fmt: skip
        spec = _spec(tmp_path / name, "diloco", sync, steps=40, **four)
        for args in legs:
            runs[name] = _train(tmp_path / name, spec, *args)
        finished = [e for e in _events(runs[name]) if e["event"] == "finished"]
        ends.append({(e["group"], e["rank"], e["step"], e["digest"]) for e in finished})
    assert ends[0] == ends[1] and len(ends[0]) == 4, ends
    ddp = _spec(tmp_path / "ddp", "diloco", sync, steps=40, launch={"devices": 4})
    runs["ddp"] = _train(tmp_path / "ddp", ddp)
    _assert_close(_weights(runs["whole"]), _weights(runs["ddp"]))
    sent = [_summary(runs[name])["sent_to_other_groups"]["bytes"] for name in ("whole", "ddp")]
    assert sent[0] * 2 == pytest.approx(sent[1], rel=0.01), sent


def test_streaming_diloco_syncs_one_fragment_in_turn_alike_in_every_group(tmp_path: Path) -> None:
    """`fragments: 2` of a GPT of 2 blocks, every 4 steps: fragment 1 after steps 2, 6, 10,
    fragment 2 after 4, 8, and both after the last; what each sync set is alike in both
    groups, and the two fragments' exchanges add up to the whole model's."""
    sync = {"method": "diloco", "every": 4, "fragments": 2}
    run_dir = _train(tmp_path, _spec(tmp_path, "fragments", sync, steps=11, layers=2))
    syncs = [e for e in _events(run_dir) if e["event"] == "sync"]
    order = sorted({(e["step"], tuple(e["fragments"])) for e in syncs})
    assert order == [(2, (0,)), (4, (1,)), (6, (0,)), (8, (1,)), (10, (0,)), (11, (0, 1))]
    by_step: dict[int, set[str]] = {}
    for event in syncs:
        by_step.setdefault(event["step"], set()).add(event["digest"])
    assert all(len(digests) == 1 for digests in by_step.values()), by_step
    sent = {e["step"]: e["bytes"] for e in syncs if e["group"] == 0}
    assert sent[2] + sent[4] == pytest.approx(sent[11], rel=0.01), sent
    assert 0.1 < sent[2] / sent[11] < 0.9 and 0.1 < sent[4] / sent[11] < 0.9, sent
    finished = [e for e in _events(run_dir) if e["event"] == "finished"]
    assert fault_events.groups_agree(finished) is True, finished
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert "sync of fragment 2/2 after step 4: 2 of 2 replica groups" in log


def test_fragments_that_do_not_divide_the_blocks_are_refused_by_validate(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "refused", {"method": "diloco", "every": 8, "fragments": 4}, layers=2)
    usage_error(
        run_train(["validate", "--config", str(spec)], tmp_path),
        "fault_tolerance.sync.fragments: 4 does not divide the model's 2 blocks (Block)",
    )
    ok = run_train(
        ["validate", "--config", str(spec), "fault_tolerance.sync.fragments=2"], tmp_path
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "diloco: 2 fragments of 1 block each, synced in turn" in ok.stdout


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["fault_tolerance.sync.method=hourly"], "fault_tolerance.sync.method"),
        (["fault_tolerance.sync.every=0"], "fault_tolerance.sync.every"),
        (["fault_tolerance.sync.outer_optim={name: Nesterov, lr: 0.7}"], "got 'Nesterov'"),
        (["fault_tolerance.enabled=false"], "set fault_tolerance.enabled: true"),
        (
            ["fault_tolerance.sync.method=local_sgd", "fault_tolerance.sync.fragments=2"],
            "fragments: 2 fragments are streaming DiLoCo's",
        ),
        (["fault_tolerance.sync.fragments=3"], "fragments: 3 does not divide every (10)"),
    ],
    ids=[
        "unknown-method",
        "every-0",
        "unknown-outer-optimizer",
        "without-groups",
        "fragments-of-local-sgd",
        "fragments-not-dividing-every",
    ],
)
def test_a_sync_that_cannot_run_is_refused_before_launch(
    tmp_path: Path, overrides: list[str], said: str
) -> None:
    spec = _spec(tmp_path, "refused", {"method": "diloco", "every": 10})
    usage_error(run_train(["--config", str(spec), *overrides], tmp_path), said)
    assert not (tmp_path / "runs").exists()


def test_a_stock_hugging_face_llama_syncs_in_fragments_of_its_decoder_layers(
    tmp_path: Path,
) -> None:
    """Streaming DiLoCo on `recipes/hf_causal_lm.py`'s Llama, built from its config: the
    fragments are cut at its own `_no_split_modules` (LlamaDecoderLayer), and the groups end
    alike."""
    pytest.importorskip("transformers")
    hf = {"source": str(REPO / "recipes" / "hf_causal_lm.py"), "model": {"family": "llama"},
          "dataset": {"seq_len": 16}}  # fmt: skip
    sync = {"method": "diloco", "every": 4, "fragments": 2}
    spec = _spec(tmp_path, "hf", sync, steps=8, recipe=hf, data={"batch_size": 4})
    checked = run_train(["validate", "--config", str(spec)], tmp_path)
    assert "diloco: 2 fragments of 2 blocks each" in checked.stdout, checked.stdout + checked.stderr
    run_dir = _train(tmp_path, spec)
    syncs = sorted(
        {(e["step"], tuple(e["fragments"])) for e in _events(run_dir) if e["event"] == "sync"}
    )
    assert syncs == [(2, (0,)), (4, (1,)), (6, (0,)), (8, (0, 1))], syncs
    assert fault_events.groups_agree(_events(run_dir)) is True

"""The run folder's storage failing: nodes that do not share it, a disk that fills up during a
save, and a worker's error file left empty or torn (what the elastic agent used to choke on)."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import socket
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from launcher.checkpoint import save_failure
from launcher.launch.agent import AgentLogs
from launcher.launch.failure_report import last_words, root_cause, storage_notes
from launcher.rundir.layout import RunLayout
from tests.conftest import TRAIN, finish_train, run_train, usage_error, write_spec
from tests.forked_train import fork_train
from tests.launch.test_multinode import finish_nodes, free_port, node_args
from tests.tiny_recipes import write_recipe

pytestmark = pytest.mark.timeout(300)

# $STORAGE_FAULT at micro-step $FAULT_AT: `fill` (rank 0 fills the disk of $FILL_FILE, as
# another program would), `metrics-full` (rank 0's metrics.jsonl hits a full disk) or `torn-error-file`/`empty-error-file` (rank 1 dies while writing
# its elastic error file). The tiny recipe's data, with a bigger model.
STORAGE_HOOKS = """
import glob
import os
import time
from torch import nn

calls = 0
FAULT = os.environ.get("STORAGE_FAULT", "")
AT = int(os.environ.get("FAULT_AT", "4"))


def build_model():
    # About 1 MB of weights: more than a full disk has room for.
    return nn.Sequential(nn.Linear(4, 512), nn.Linear(512, 512), nn.Linear(512, 1))


def fill_disk(path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"x" * 65536)
    except OSError:
        pass
    os.close(fd)
    # 256 KB left (FILL_LEAVE_KB): room for log lines, not for a checkpoint.
    os.truncate(path, os.path.getsize(path) - int(os.environ.get("FILL_LEAVE_KB", "256")) * 1024)


def after_a_complete_checkpoint(disk):
    # An async save of step 10 may still be writing at step 15: the disk fills once a
    # checkpoint is published, as the test means it to, however fast the steps are.
    deadline = time.monotonic() + 60
    pattern = os.path.join(disk, "runs", "*", "*", "checkpoints", "*", "COMPLETE")
    while not glob.glob(pattern) and time.monotonic() < deadline:
        time.sleep(0.01)


def loss(model, batch):
    global calls
    calls += 1
    if calls == AT and FAULT == "fill" and os.environ["RANK"] == "0":
        if os.environ.get("FILL_AFTER_A_CHECKPOINT"):
            after_a_complete_checkpoint(os.path.dirname(os.environ["FILL_FILE"]))
        fill_disk(os.environ["FILL_FILE"])
    if calls == AT and FAULT == "metrics-full" and os.environ["RANK"] == "0":
        full = os.open("/dev/full", os.O_WRONLY)  # every write to it: ENOSPC
        for fd in os.listdir("/proc/self/fd"):
            if os.path.realpath(f"/proc/self/fd/{fd}").endswith("metrics.jsonl"):
                os.dup2(full, int(fd))
    if calls == AT and FAULT.endswith("error-file") and os.environ["RANK"] == "1":
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            f.write('{"message": {"mess' if FAULT.startswith("torn") else "")
        print("dying while writing its error file", flush=True)
        os._exit(1)
    return tiny.loss(model, batch)
"""


def _spec(tmp_path: Path, output_dir: Path, **checkpoint: object) -> Path:
    write_recipe(tmp_path, STORAGE_HOOKS, "storage.py")
    return write_spec(
        tmp_path / "run.yaml",
        run={"output_dir": str(output_dir)},
        recipe={"source": str(tmp_path / "storage.py"), "dataset": {}},
        train={"max_steps": 30, "log_every": 5},
        checkpoint={"every_n_steps": 10, **checkpoint},
    )


def test_nodes_with_run_folders_of_their_own_are_refused_before_training(tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path / "run.yaml",
        launch={"devices": 1},
        train={"max_steps": 6, "log_every": 3},
        checkpoint={"every_n_steps": 3},
    )

    def nodes(job: str, *run_dirs: Path) -> list[subprocess.CompletedProcess[str]]:
        port = free_port()
        args = [
            node_args(spec, rank, port, job, "--run-dir", str(run_dirs[rank])) for rank in (0, 1)
        ]
        # Node 1 first: it waits for node 0, which hosts the rendezvous.
        procs = [fork_train(a, cwd=tmp_path) for a in args[::-1]][::-1]
        return finish_nodes(procs, tmp_path)

    own = [tmp_path / "node0", tmp_path / "node1"]
    for result, run_dir in zip(nodes("own", *own), own, strict=True):
        usage_error(
            result,
            "error: the nodes do not share the run folder: rank 0 (on",
            f"rank 1 on {socket.gethostname()} looked in {own[1]}",
            "storage every node sees",
            "--run-dir, or run.output_dir",
        )
        assert "step 3/6" not in result.stdout  # refused before training, not at the save
        assert not list(run_dir.glob("checkpoints/step-*"))

    shared = tmp_path / "shared"
    for result in nodes("shared", shared, shared):
        assert result.returncode == 0, result.stdout + result.stderr
    assert (shared / "checkpoints" / "step-00000006" / "COMPLETE").is_file()
    assert not list(shared.glob(".shared-check*"))


# Mounts a small tmpfs in a mount namespace of its own (no root needed where user namespaces
# are allowed), and runs `train` twice there: the disk fills up, then, freed, it resumes.
_ON_SMALL_DISK = """
mount -t tmpfs -o size=8m tmpfs "$DISK" || exit 77
STORAGE_FAULT=fill "$TRAIN" --config run.yaml > full.out 2>&1
echo $? > full.rc
find "$DISK" -path "*checkpoints*" > full.tree
rm "$DISK/filler"
"$TRAIN" --config run.yaml --resume latest > resumed.out 2>&1
echo $? > resumed.rc
find "$DISK" -path "*checkpoints*" > resumed.tree
"""


def _skip_without_namespaces() -> None:
    if (
        shutil.which("unshare") is None
        or subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True
        ).returncode
    ):
        pytest.skip("no user and mount namespaces here, so no disk of our own to mount")


def _in_namespace(script: str, tmp_path: Path, env: dict[str, str]) -> int:
    """`script` in a user and mount namespace of its own, where it may mount; its exit code."""
    proc = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        cwd=tmp_path,
        env={**os.environ, "COLUMNS": "200", "TRAIN": str(TRAIN), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    done = finish_train(proc, tmp_path, timeout=280)
    if done.returncode == 77:
        pytest.skip(f"cannot mount here: {done.stderr}")
    return done.returncode


_ON_READ_ONLY_CHECKPOINTS = """
mount -t tmpfs -o size=64m tmpfs "$DISK" || exit 77
"$TRAIN" --config run.yaml train.max_steps=20 > first.out 2>&1 || exit 78
checkpoints=$(echo "$DISK"/runs/t/*/checkpoints)
mount --bind "$checkpoints" "$checkpoints" || exit 77
mount -o remount,bind,ro "$checkpoints" || exit 77
"$TRAIN" --config run.yaml --resume latest train.max_steps=30 > resumed.out 2>&1
echo $? > resumed.rc
"""


def test_a_read_only_checkpoints_folder_is_refused_before_any_step(tmp_path: Path) -> None:
    _skip_without_namespaces()
    disk = tmp_path / "disk"
    disk.mkdir()
    _spec(tmp_path, disk / "runs")
    code = _in_namespace(_ON_READ_ONLY_CHECKPOINTS, tmp_path, {"DISK": str(disk)})
    assert code == 0, (tmp_path / "first.out").read_text()
    resumed = (tmp_path / "resumed.out").read_text()
    assert (tmp_path / "resumed.rc").read_text().strip() == "2", resumed
    assert ": cannot write in checkpoints/ (Read-only file system)" in resumed, resumed
    assert resumed.startswith("error: run folder ")  # not "--run-dir": none was given
    assert "Traceback" not in resumed and "step 21" not in resumed


_ON_A_DISK_LEFT_FULL = """
mount -t tmpfs -o size=8m tmpfs "$DISK" || exit 77
"$TRAIN" --config run.yaml > full.out 2>&1
echo $? > full.rc
cat "$DISK"/runs/t/*/outcome.json > outcome.json
ls -A "$DISK"/runs/t/* > folder.txt
"""


def test_a_run_whose_disk_is_left_full_still_records_how_it_ended(tmp_path: Path) -> None:
    _skip_without_namespaces()
    disk = tmp_path / "disk"
    disk.mkdir()
    _spec(tmp_path, disk / "runs")
    env = {"DISK": str(disk), "FILL_FILE": str(disk / "filler"), "FILL_LEAVE_KB": "0"}
    _in_namespace(_ON_A_DISK_LEFT_FULL, tmp_path, {**env, "STORAGE_FAULT": "fill", "FAULT_AT": "5"})
    full = (tmp_path / "full.out").read_text()
    assert (tmp_path / "full.rc").read_text().strip() == "1", full
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    assert outcome["status"] == "failed" and outcome["exit_code"] == 1, outcome
    folder = (tmp_path / "folder.txt").read_text().split()
    assert not [name for name in folder if name.startswith(".outcome")], folder


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_disk_that_fills_up_during_a_save(tmp_path: Path, use_async: bool) -> None:
    _skip_without_namespaces()
    disk = tmp_path / "disk"
    disk.mkdir()
    _spec(tmp_path, disk / "runs", **{"async": use_async})
    env = {"DISK": str(disk), "FILL_FILE": str(disk / "filler"), "FAULT_AT": "15"}
    env["FILL_AFTER_A_CHECKPOINT"] = "1"  # step 10's save (async: still running at step 15)
    _in_namespace(_ON_SMALL_DISK, tmp_path, env)
    full = (tmp_path / "full.out").read_text()
    assert (tmp_path / "full.rc").read_text().strip() == "1", full
    assert "JSONDecodeError" not in full and "torch.distributed.elastic failed" not in full
    assert "error: disk full while writing checkpoint step-00000020 to " in full, full
    assert "earlier checkpoints are intact (newest: step-00000010)" in full
    assert "Free space on that disk, or keep fewer checkpoints (checkpoint.keep_last)" in full
    tree = (tmp_path / "full.tree").read_text()
    assert "step-00000010/COMPLETE" in tree and ".partial" not in tree, tree

    resumed = (tmp_path / "resumed.out").read_text()
    assert (tmp_path / "resumed.rc").read_text().strip() == "0", resumed
    assert "resumed at step 10" in resumed
    assert "step-00000030/COMPLETE" in (tmp_path / "resumed.tree").read_text()


def test_a_full_disk_at_metrics_jsonl_is_warned_of_and_the_run_goes_on(tmp_path: Path) -> None:
    spec = _spec(tmp_path, tmp_path / "runs")
    result = run_train(
        ["--config", str(spec)], tmp_path, env={"STORAGE_FAULT": "metrics-full", "FAULT_AT": "7"}
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Traceback" not in output
    assert "metrics.jsonl: cannot write it (No space left on device); training goes on" in output
    run = next((tmp_path / "runs" / "t").iterdir())
    assert (run / "checkpoints" / "step-00000030" / "COMPLETE").is_file()
    assert json.loads((run / "outcome.json").read_text())["status"] == "finished"


@pytest.mark.parametrize("content", ["torn", "empty"])
def test_a_broken_worker_error_file_is_reported_as_the_rank_failing(
    tmp_path: Path, content: str
) -> None:
    spec = _spec(tmp_path, tmp_path / "runs")
    result = run_train(
        ["--config", str(spec)], cwd=tmp_path, env={"STORAGE_FAULT": f"{content}-error-file"}
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "JSONDecodeError" not in output and "torch.distributed.elastic failed" not in output
    assert "rank 1 failed on" in output
    assert "dying while writing its error file" in output


def test_the_agent_is_never_handed_a_worker_error_file(tmp_path: Path) -> None:
    envs: dict[int, dict[str, str]] = {0: {"TORCHELASTIC_RUN_ID": "r"}, 1: {}}
    dest = AgentLogs(log_dir=str(tmp_path)).reify(envs)
    for rank in (0, 1):
        written = Path(envs[rank]["TORCHELASTIC_ERROR_FILE"])  # workers still write theirs
        written.write_text("")
        failure = ProcessFailure(rank, pid=1, exitcode=1, error_file=dest.error_files[rank])
        assert failure.exitcode == 1 and failure.message


def test_a_write_that_hit_a_full_disk_says_so_whatever_torch_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch_save = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704")
    with pytest.raises(RuntimeError), save_failure.explained_writes(tmp_path):
        raise torch_save  # plenty of space: not the disk's doing
    monkeypatch.setattr(save_failure, "free_bytes", lambda where: 4096)
    with pytest.raises(OSError) as raised, save_failure.explained_writes(tmp_path / "f"):
        raise torch_save
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(tmp_path / "f")
    # As DCP hands it to every rank: pickled (no __context__), in a CheckpointException.
    gathered = CheckpointException("write", {1: (pickle.loads(pickle.dumps(raised.value)), [])})
    assert (save_failure.limit_hit(gathered) or OSError()).errno == errno.ENOSPC
    assert save_failure.limit_hit(CheckpointException("write", {1: (torch_save, [])})) is None


@pytest.mark.launcher_only
def test_the_panel_shows_the_error_a_rank_printed_after_a_traceback() -> None:
    traceback = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: x\n'
    error = "error: disk full while writing\n  a detail\nFree space.\n"
    assert last_words("step 1\n" + traceback + error) == error.rstrip("\n")
    assert last_words(error + traceback) == traceback.rstrip("\n")
    assert last_words(error + "".join(f"line {i}\n" for i in range(9))) == error.splitlines()[0]


@pytest.mark.launcher_only
def test_a_save_that_did_not_finish_is_reported(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    assert storage_notes(layout) == []
    layout.staging(20).mkdir(parents=True)
    (layout.staging(20) / "__0_0.distcp").write_bytes(b"x" * 2**20)
    layout.checkpoint(10).mkdir()
    (layout.checkpoint(10) / "COMPLETE").touch()
    (notes,) = storage_notes(layout)
    assert f"{layout.staging(20)} (1.0 MB)" in notes and "delete it" in notes


@pytest.mark.launcher_only
def test_a_rank_that_died_before_it_could_record_comes_before_its_peers(tmp_path: Path) -> None:
    # Rank 1 died at 100.95 without a failure record (os._exit, or a disk too full for one);
    # rank 0 lost it and recorded at 100.97; the agent saw rank 1 go in second 101.
    layout = RunLayout(tmp_path)
    layout.telemetry_dir.mkdir()
    layout.failure(0).write_text(json.dumps({"rank": 0, "pid": 10, "failed_at": 100.97}))
    layout.logs.mkdir()
    layout.log(1).write_text("dying\n")
    os.utime(layout.log(1), (100.95, 100.95))
    failures = {
        0: SimpleNamespace(exitcode=1, timestamp=101, pid=10),
        1: SimpleNamespace(exitcode=1, timestamp=101, pid=11),
    }
    assert root_cause(failures, tmp_path)[0] == 1

"""Failures, injected from outside the way real ones happen: a crashing rank, a hung rank, a
rank killed by the kernel, Ctrl-C and SIGTERM to the launcher, and automatic restarts. Each
test checks the exit code, the message, the checkpoints and that no process is left behind
(finish_train walks the process table)."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from launcher.checkpoint.catalog import latest_complete
from launcher.launch.watchdog import Watchdog
from launcher.rundir.layout import RunLayout
from tests.conftest import (
    FAULTY_RECIPE,
    finish_train,
    run_train,
    start_train,
    wait_for_step,
    write_spec,
)
from tests.forked_train import fork_train
from tests.tiny_recipes import write_recipe
from tests.watchdog_clock import WatchdogClock

pytestmark = pytest.mark.timeout(300)


def _spec(tmp_path: Path, **train: object) -> Path:
    (tmp_path / "faulty.py").write_text(FAULTY_RECIPE)
    return write_spec(
        tmp_path / "run.yaml",
        recipe={"source": "faulty.py", "dataset": {}},
        train={"max_steps": 30, "log_every": 5, **train},
        checkpoint={"every_n_steps": 1},
    )


def _weights(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(checkpoint, scratch)
    return torch.load(scratch, weights_only=True)["model"]


def test_a_crashing_rank_gets_a_root_cause_panel_and_the_others_stop(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    result = run_train(["--config", str(spec)], cwd=tmp_path, env={"FAULT": "raise"})
    ended = time.time()
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "rank 1 failed on" in output  # the root cause, not rank 0 that lost its peer
    assert "rank 0 failed" not in output
    assert "how: exited with an error (exit code 1)" in output
    assert "RuntimeError: boom on rank 1" in output
    assert "faulty.py" in output  # the user's own frame is in the panel's traceback
    # Every other rank is stopped at once (finish_train checks that none is left); allow
    # for the launcher's own exit on a loaded machine.
    assert ended - float((tmp_path / "crashed_at").read_text()) < 10


@pytest.mark.parametrize(
    ("fault", "sig", "words"),
    [
        ("segv", signal.SIGSEGV, "segmentation fault (SIGSEGV)"),
        ("sigkill", signal.SIGKILL, "killed (SIGKILL): most often the kernel's out-of-memory"),
    ],
)
def test_a_rank_killed_by_a_signal_is_the_root_cause_in_plain_words(
    tmp_path: Path, fault: str, sig: signal.Signals, words: str
) -> None:
    run_dir = tmp_path / "run"
    proc = fork_train(
        ["--config", str(_spec(tmp_path)), "--run-dir", str(run_dir)],
        tmp_path,
        {"FAULT": "segv" if fault == "segv" else "slow"},
    )
    if fault == "sigkill":  # from outside, as the OOM killer does
        os.kill(wait_for_step(run_dir, 1, 3, proc), signal.SIGKILL)
    result = finish_train(proc, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 128 + sig, output
    assert "rank 1 failed on" in output
    assert words in output


def test_the_watchdog_names_a_hung_rank_and_shows_where_it_is(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    result = run_train(
        ["--config", str(spec), "--stall-timeout", "4"], cwd=tmp_path, env={"FAULT": "sleep"}
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "stopped: no progress for 4 s (launch.stall_timeout)" in output
    hung = next(line for line in output.splitlines() if line.startswith("rank 1: no progress"))
    assert "after step 3" in hung and "faulty.py" in hung and "in loss" in hung, output
    # Its stack, from faulthandler, is in its log (and on screen).
    assert "Current thread" in output


def _new_run_dir(runs: Path) -> Path:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = list(runs.glob("*")) if runs.is_dir() else []
        if found:
            return found[0]
        time.sleep(0.05)
    pytest.fail(f"no run folder appeared in {runs}")


STEPS = 25  # of the runs that are stopped and resumed or restarted


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The final weights of a run of STEPS steps that nothing stopped."""
    folder = tmp_path_factory.mktemp("reference")
    spec = _spec(folder, max_steps=STEPS)
    result = run_train(["--config", str(spec), "--run-dir", str(folder / "run")], cwd=folder)
    assert result.returncode == 0, result.stdout + result.stderr
    return _weights(folder / "run" / "checkpoints" / f"step-{STEPS:08d}", folder / "ref.pt")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_first_signal_saves_and_exits_then_resume_latest_is_exact(
    tmp_path: Path, sig: signal.Signals, uninterrupted: dict[str, torch.Tensor]
) -> None:
    spec = _spec(tmp_path, max_steps=STEPS)
    proc = fork_train(["--config", str(spec)], tmp_path, {"FAULT": "slow"})
    run_dir = _new_run_dir(tmp_path / "runs" / "t")
    wait_for_step(run_dir, 0, 5, proc)
    os.kill(proc.pid, sig)
    result = finish_train(proc, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 128 + sig, output
    assert "every rank finishes its step and saves a checkpoint" in output
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert 5 <= int(saved[-1].split("-")[1]) < STEPS, saved
    assert f"stopped by {sig.name}; saved" in output

    resumed = run_train(["--config", str(spec), "--resume", "latest"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    final = _weights(run_dir / "checkpoints" / f"step-{STEPS:08d}", tmp_path / "final.pt")
    assert all(torch.equal(final[k], uninterrupted[k]) for k in uninterrupted)


def test_a_second_signal_stops_everything_at_once(tmp_path: Path) -> None:
    spec = _spec(tmp_path, max_steps=1000)
    run_dir = tmp_path / "run"
    proc = fork_train(
        ["--config", str(spec), "--run-dir", str(run_dir)], tmp_path, {"FAULT": "sleep"}
    )
    # Once rank 1 sleeps inside its step, a graceful stop cannot finish (after step 3 alone
    # it could: the ranks might still agree to stop there).
    deadline = time.monotonic() + 60
    while not (tmp_path / "sleeping").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "rank 1 never slept"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    # The launcher took the first one (it asks the ranks to stop): two signals sent before
    # its handler runs would be taken as one.
    deadline = time.monotonic() + 60
    while not RunLayout(run_dir).stop_request.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the first SIGINT not taken"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    result = finish_train(proc, tmp_path, timeout=30)
    output = result.stdout + result.stderr
    assert result.returncode == 130, output
    assert "stopped at once by a second SIGINT" in output


def test_max_restarts_recovers_from_a_killed_rank_to_the_same_weights(
    tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    spec = _spec(tmp_path, max_steps=STEPS)
    run_dir = tmp_path / "run"
    proc = fork_train(
        ["--config", str(spec), "--run-dir", str(run_dir), "--max-restarts", "1"],
        tmp_path,
        {"FAULT": "slow"},
    )
    os.kill(wait_for_step(run_dir, 1, 5, proc), signal.SIGKILL)
    result = finish_train(proc, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "attempt 2 of 2: restarted after a failure; resuming from" in output
    final = _weights(run_dir / "checkpoints" / f"step-{STEPS:08d}", tmp_path / "final.pt")
    assert all(torch.equal(final[k], uninterrupted[k]) for k in uninterrupted)


def test_rendezvous_listens_on_loopback_only_and_nothing_is_world_writable(
    tmp_path: Path,
) -> None:
    spec = _spec(tmp_path, max_steps=15)
    run_dir = tmp_path / "run"
    proc = start_train(
        ["--config", str(spec), "--run-dir", str(run_dir)],
        tmp_path,
        {"FAULT": "slow"},
        preexec_fn=lambda: os.umask(0),  # the most permissive umask a user could have
    )
    wait_for_step(run_dir, 0, 2, proc)
    listening = [
        c.laddr.ip
        for c in psutil.Process(proc.pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    result = finish_train(proc, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert listening and set(listening) <= {"127.0.0.1"}, listening
    for path in [run_dir, *run_dir.rglob("*")]:
        assert not path.stat().st_mode & stat.S_IWOTH, path


def test_the_watchdog_allows_startup_longer_and_restarts_start_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog on heartbeat files alone: a rank gets 3 timeouts until it has finished a
    step of its own (building, restoring, compiling), 1 after, and a new pid starts it over.
    A step of its own is one past the step its heartbeat says it started from, however many
    steps went by between two looks."""
    clock = WatchdogClock(monkeypatch)
    (tmp_path / "telemetry").mkdir()
    beat = tmp_path / "telemetry" / "rank-0.beat"
    watchdog = Watchdog(tmp_path, range(1), timeout_s=0.4)

    def write(step: int, beats: int, pid: int, start: int) -> None:
        beat.write_text(f"{step} {beats} {pid} {start} 0\n")
        assert watchdog.check() == []

    write(0, 1, 111, -1)  # building
    write(40, 2, 111, 40)  # restored at step 40: not a step of its own
    clock.sleep(0.6)
    assert watchdog.check() == []  # 0.6 s < 3 x 0.4 s: still starting up
    write(60, 9, 111, 40)  # twenty steps since the last look: one timeout applies now
    clock.sleep(0.6)
    [stall] = watchdog.check()
    assert (stall.rank, stall.step) == (0, 60)
    write(40, 1, 222, -1)  # restarted: another process, starting up again
    clock.sleep(0.6)
    assert watchdog.check() == []


def test_after_a_stop_only_a_rank_in_a_step_of_known_length_gets_the_short_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After Ctrl-C a rank has the grace (or 4 of its slowest steps) to finish the step it is
    in; one that is saving or evaluating, or whose step time is not known yet, is left to the
    stall timeout."""
    clock = WatchdogClock(monkeypatch)
    (tmp_path / "telemetry").mkdir()
    beat = tmp_path / "telemetry" / "rank-0.beat"
    watchdog = Watchdog(tmp_path, range(1), timeout_s=100)

    def write(step: int, busy: int = 0, pause: float = 0.03) -> None:
        beat.write_text(f"{step} {step + busy} 111 0 {busy}\n")
        assert watchdog.check() == []
        clock.sleep(pause)

    write(1)
    write(2)
    write(3)
    assert watchdog.check_after_stop(asked_s=5, grace_s=0.2) == []  # one gap seen: unknown
    write(4)
    write(5, pause=0.5)
    [stall] = watchdog.check_after_stop(asked_s=0.3, grace_s=0.2)  # in step 6, 0.3 s > 4 x 0.03
    assert stall.step == 5
    write(6, busy=1, pause=0.5)  # saving when the stop came
    assert watchdog.check_after_stop(asked_s=0.3, grace_s=0.2) == []
    write(7, pause=0.5)  # a step of 0.5 s: 4 of them is the grace now
    assert watchdog.check_after_stop(asked_s=0.3, grace_s=0.2) == []


def read_end(path: Path, size: int = 1 << 16) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - size))
        return f.read().decode(errors="replace")


def _peak_rss_mib(proc: subprocess.Popen[str], pid: int) -> float:
    """The launcher process's peak resident memory until it exits, sampled every 10 ms."""
    peak = 0.0
    launcher = psutil.Process(pid)
    while proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            peak = max(peak, launcher.memory_info().rss / 2**20)
        time.sleep(0.01)
    return peak


@pytest.mark.parametrize("fault", ["flood", "flood-then-hang"])
def test_a_flooded_log_costs_the_launcher_little_memory_when_it_reports(
    tmp_path: Path, fault: str
) -> None:
    """A rank writes 500 MiB of log, then fails or hangs: the launcher reads the end of its
    log for the report, not all of it (it peaked at over 2 GiB reading 1 GB whole)."""
    spec = _spec(tmp_path)
    flags = ["--stall-timeout", "10"] if fault == "flood-then-hang" else []
    # Into a file: a pipe nobody drains while the memory is sampled would stall the display.
    with open(tmp_path / "output.txt", "w") as output_file:
        proc = start_train(
            ["--config", str(spec), *flags],
            tmp_path,
            env={"FAULT": fault},
            stdout=output_file,
            stderr=subprocess.STDOUT,
        )
        peak = _peak_rss_mib(proc, proc.pid)
        result = finish_train(proc, tmp_path)
    # The end of the output, and more: a display that gave up draining the flood may still be
    # writing one block (8 MiB) of it around the report's lines.
    output = read_end(tmp_path / "output.txt", 32 << 20)
    assert result.returncode == 1, output[-3000:]
    output = "\n".join(line for line in output.splitlines() if not line.endswith("xxxx"))
    if fault == "flood":
        assert "RuntimeError: boom on rank 1 after a flood" in output
    else:
        assert "rank 1: no progress" in output and "faulty.py" in output
    assert peak < 600, f"the launcher peaked at {peak:.0f} MiB"


@pytest.mark.parametrize("hang_at", [3, 20])
def test_a_hang_after_fast_steps_is_caught_in_one_stall_timeout(
    tmp_path: Path, hang_at: int
) -> None:
    """Steps faster than the watchdog looks (it saw a step change once, or twice): a hang is
    caught one stall_timeout after the last step, not three (the rank had surely stepped)."""
    spec = _spec(tmp_path, log_every=50)
    timeout = 6
    proc = fork_train(
        ["--config", str(spec), "--stall-timeout", str(timeout), "checkpoint.every_n_steps=100"],
        tmp_path,
        env={"FAULT": "sleep", "FAULT_AT": str(hang_at)},
    )
    result = finish_train(proc, tmp_path)
    ended = time.time()
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "rank 1: no progress" in output and f"after step {hang_at - 1}" in output, output
    hung_at = (tmp_path / "sleeping").stat().st_mtime
    print(f"caught and stopped {ended - hung_at:.1f} s after the hang")
    # One stall timeout and the ranks' stop, with room for a loaded machine; the failure it
    # guards takes three (18 s).
    assert ended - hung_at < 2 * timeout, ended - hung_at


# The tiny recipe's model and loss on a dataset with one sample that cannot be read.
BAD_SAMPLE_HOOKS = """
import torch
from torch.utils.data import Dataset


class Samples(Dataset):
    def __len__(self):
        return 512

    def __getitem__(self, i):
        if i == 77:
            raise ValueError(f"sample {i} cannot be decoded")
        return torch.ones(4) * i / 512, torch.zeros(1)


def build_dataset(split):
    return Samples()
"""


def test_an_error_in_a_dataloader_worker_shows_its_own_message_and_frame(tmp_path: Path) -> None:
    write_recipe(tmp_path, BAD_SAMPLE_HOOKS, "bad_sample.py")
    spec = write_spec(
        tmp_path / "run.yaml",
        recipe={"source": "bad_sample.py", "dataset": {}},
        data={"batch_size": 8, "num_workers": 2, "shuffle": False},
        train={"max_steps": 20},
    )
    result = run_train(["--config", str(spec)], tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    panel = output[output.index("failed on") :]
    assert "ValueError: sample 77 cannot be decoded" in panel, panel
    assert "bad_sample.py" in panel and "in __getitem__" in panel, panel
    assert "killed by signal" not in output, output


def test_a_stopped_rank_is_named_stopped_not_stack_unknown(tmp_path: Path) -> None:
    spec = _spec(tmp_path, max_steps=1000)
    proc = fork_train(
        ["--config", str(spec), "--stall-timeout", "3"], tmp_path, env={"FAULT": "slow"}
    )
    run_dir = _new_run_dir(tmp_path / "runs" / "t")
    pid = wait_for_step(run_dir, 1, 3, proc)
    os.kill(pid, signal.SIGSTOP)
    result = finish_train(proc, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    line = next(x for x in output.splitlines() if x.startswith("rank 1: no progress"))
    assert "its process is stopped (SIGSTOP" in line, output


def test_ctrl_c_on_a_hung_run_ends_it_without_waiting_for_the_stall_timeout(
    tmp_path: Path,
) -> None:
    spec = _spec(tmp_path)
    proc = fork_train(
        ["--config", str(spec), "--stall-timeout", "120"],
        tmp_path,
        env={"FAULT": "sleep", "FAULT_AT": "20"},
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "sleeping").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1)
    asked = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    result = finish_train(proc, tmp_path, timeout=60)
    took = time.monotonic() - asked
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "stopped at once: after SIGINT, the ranks did not finish their step (hung)" in output
    assert "rank 1: no progress" in output and "faulty.py" in output, output
    assert took < 20, took  # the grace for a step (10 s), not the stall timeout (120 s)


def test_a_run_folder_deleted_mid_run_is_named_and_the_run_stops_with_a_checkpoint(
    tmp_path: Path,
) -> None:
    spec = _spec(tmp_path, max_steps=1000)
    proc = fork_train(
        ["--config", str(spec), "--stall-timeout", "10", "checkpoint.every_n_steps=500"],
        tmp_path,
        env={"FAULT": "slow", "FAULT_RANK": "0"},
    )
    run_dir = _new_run_dir(tmp_path / "runs" / "t")
    wait_for_step(run_dir, 0, 5, proc)
    # Gone at once, as an `rm -rf` looks to the run. An rmtree of the live folder races the
    # ranks' writes into it ("Directory not empty"); the moved one is removed once they end.
    deleted = tmp_path / "deleted"
    run_dir.rename(deleted)
    result = finish_train(proc, tmp_path)
    shutil.rmtree(deleted)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert f"the run folder {run_dir} was deleted or moved while the run ran" in output, output
    assert "no progress" not in output  # not taken for a hang
    assert f"Continue with: --resume {run_dir}" in output
    assert latest_complete(run_dir) is not None  # in the new folder


@pytest.mark.launcher_only
def test_the_failure_panel_shows_a_ranks_escape_codes_as_text(tmp_path: Path) -> None:
    """A rank's traceback may carry anything (a tensor's name, a recipe's message): the panel
    shows its control characters escaped, as the live display does."""
    from rich.console import Console

    from launcher.launch.failure_report import failure_panel

    log = tmp_path / "rank-0.log"
    log.write_text(
        "Traceback (most recent call last):\n"
        '  File "recipe.py", line 3, in loss\n'
        "KeyError: 'w\x1b]8;;https://evil.example\x07x\x1b[2J'\n"
    )
    console = Console(file=io.StringIO(), width=200, color_system=None, force_terminal=False)
    console.print(failure_panel(0, "host", 1, log))
    shown = console.file.getvalue()
    assert "\x1b" not in shown and "\x07" not in shown, repr(shown)
    assert "KeyError: 'w\\x1b]8;;https://evil.example\\x07x\\x1b[2J'" in shown, shown

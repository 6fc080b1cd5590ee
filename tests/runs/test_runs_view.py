"""`train runs` and `train plot`, on real runs of the launcher: one that finishes, one whose
rank fails, and one listed while it runs and then stopped with Ctrl-C. The three run at once,
once for the module; each test reads them (or a copy it changes) through the CLI, as a user
or a script does."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.runs.plot import DPI, FIGURE_WIDTH, PANEL_HEIGHT
from tests.conftest import (
    FAULTY_RECIPE,
    REPO,
    finish_train,
    free_port,
    usage_error,
    wait_for_step,
    write_spec,
)
from tests.forked_train import fork_train

pytestmark = pytest.mark.timeout(120)

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="no matplotlib here"
)
needs_plotext = pytest.mark.skipif(
    importlib.util.find_spec("plotext") is None, reason="no plotext here"
)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`train ARGS`, as `python -m launcher.cli.app`, in the repo (its recipes import from it)."""
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli.app", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200", "LINES": "50", **(env or {})},
    )


def listed(output_dir: Path, *args: str) -> dict[str, dict]:
    """`train runs --json`, by run name."""
    result = cli("runs", "--output-dir", str(output_dir), "--json", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    return {row["name"]: row for row in json.loads(result.stdout)}


def _spec(folder: Path, name: str, output_dir: Path, **sections: dict) -> list[str]:
    folder.mkdir()
    (folder / "faulty.py").write_text(FAULTY_RECIPE)
    run = {"name": name, "output_dir": str(output_dir)}
    spec = write_spec(folder / "run.yaml", run=run, launch={"devices": 1}, **sections)
    return ["--config", str(spec)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    """The output folder of three runs, and `train runs --json` while the third ran."""
    top = tmp_path_factory.mktemp("runs_view")
    out = top / "runs"
    faulty = {"recipe": {"source": "faulty.py", "dataset": {}}}
    good = _spec(
        top / "good",
        "good",
        out,
        train={"max_steps": 8, "log_every": 1},
        eval={"every_n_steps": 4},
        checkpoint={"every_n_steps": 4, "monitor": "val/loss"},
    )
    bad = _spec(top / "bad", "bad", out, train={"max_steps": 8, "log_every": 1}, **faulty)
    slow = _spec(top / "slow", "slow", out, train={"max_steps": 1000, "log_every": 1}, **faulty)
    slow_dir = out / "slow" / "r1"
    procs = [
        (fork_train(good, top / "good"), top / "good"),
        (fork_train(bad, top / "bad", {"FAULT": "raise", "FAULT_RANK": "0"}), top / "bad"),
        (
            fork_train(
                [*slow, "--run-dir", str(slow_dir), "checkpoint.every_n_steps=2"],
                top / "slow",
                {"FAULT": "slow", "FAULT_RANK": "0"},
            ),
            top / "slow",
        ),
    ]
    try:
        codes = [finish_train(proc, cwd).returncode for proc, cwd in procs[:2]]
        assert codes == [0, 1], codes
        slow_proc = procs[2][0]
        wait_for_step(slow_dir, 0, 3, slow_proc)
        while_running = listed(out)
        os.kill(slow_proc.pid, signal.SIGINT)
        assert finish_train(slow_proc, top / "slow").returncode == 130
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return out, while_running


def test_statuses_of_finished_failed_running_and_stopped_runs(runs: tuple[Path, dict]) -> None:
    out, while_running = runs
    running = while_running["slow"]
    assert running["status"] == "running" and running["exit_code"] is None
    assert running["step"] >= 3 and running["total_steps"] == 1000
    assert running["ended"] is None and running["duration_s"] > 0

    rows = listed(out)
    assert {n: (r["status"], r["exit_code"]) for n, r in rows.items()} == {
        "good": ("finished", 0),
        "bad": ("failed", 1),
        "slow": ("stopped", 130),
    }
    assert rows["slow"]["reason"] == "SIGINT" and rows["bad"]["reason"] == "a rank failed"
    table = cli("runs", "--output-dir", str(out))
    assert table.returncode == 0, table.stderr
    lines = {line.split()[0]: line for line in table.stdout.splitlines()[1:]}
    assert "finished" in lines["good"] and "8/8" in lines["good"]
    assert "best val/loss" in table.stdout  # the metric every run is kept by
    assert "failed (exit 1)" in lines["bad"]
    assert "stopped (SIGINT)" in lines["slow"] and "/1000" in lines["slow"]


def test_json_fields_name_filter_and_config(runs: tuple[Path, dict]) -> None:
    out, _ = runs
    good = listed(out, "good")
    assert list(good) == ["good"]
    row = good["good"]
    metrics = [json.loads(line) for line in (Path(row["folder"]) / "metrics.jsonl").open()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    vals = [(m["val/loss"], m["step"]) for m in metrics if "val/loss" in m]
    assert (row["step"], row["total_steps"]) == (8, 8)
    assert row["last_loss"] == losses[-1] and row["best_loss"] == min(losses)
    assert (row["best_val_metric"], row["best_val"], row["best_val_step"]) == (
        "val/loss",
        *min(vals),
    )
    assert row["checkpoint"].endswith("step-00000008") and row["checkpoint_step"] == 8
    assert row["started"] <= row["ended"] and row["duration_s"] > 0
    # With --config: its output folder, and its run's name.
    by_config = cli("runs", "--config", str(out.parent / "bad" / "run.yaml"), "--json")
    assert [r["name"] for r in json.loads(by_config.stdout)] == ["bad"], by_config.stderr
    nothing = cli("runs", "--output-dir", str(out), "nosuch")
    assert nothing.returncode == 0 and "no runs of 'nosuch'" in nothing.stderr
    usage_error(cli("runs", "--output-dir", str(out / "nosuch")), "no such folder")


def test_a_half_written_line_and_a_silent_end(runs: tuple[Path, dict], tmp_path: Path) -> None:
    """A run whose launcher was killed (no outcome, no lock held) mid-write."""
    out, _ = runs
    good = Path(listed(out, "good")["good"]["folder"])
    lost = tmp_path / "runs" / "lost" / good.name
    shutil.copytree(good, lost)
    (lost / "outcome.json").unlink()
    with (lost / "metrics.jsonl").open("a") as f:
        f.write('{"step": 9, "loss": 0.0')  # cut short, as a kill leaves it
    row = listed(tmp_path / "runs")["good"]  # its spec's run.name, whatever its folder
    assert row["status"] == "interrupted" and row["exit_code"] is None
    assert row["step"] == 8 and row["best_loss"] > 0.0
    assert row["ended"] is not None


def test_runs_lists_any_folders_given_as_paths(runs: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = runs
    # Where `--run-dir elsewhere/x` puts a run: outside every run.output_dir.
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(Path(listed(out, "good")["good"]["folder"]), elsewhere / "x")
    (tmp_path / "quickstart").mkdir()  # a folder, so `quickstart` is a PATH here

    def names(*args: str) -> list[str]:
        result = subprocess.run(
            [sys.executable, "-m", "launcher.cli.app", "runs", "--json", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert result.returncode == 0, result.stderr
        return sorted(row["name"] for row in json.loads(result.stdout))

    assert names("elsewhere/x") == ["good"]  # a run folder
    assert names("elsewhere") == ["good"]  # a folder that holds one
    assert names(str(out)) == ["bad", "good", "slow"]  # an output folder
    assert names(str(out / "slow")) == ["slow"]  # a folder of one name's runs
    assert names(str(out), "elsewhere", "good") == ["good", "good"]  # NAME filters the PATHs
    assert names(str(out), str(out / "good")) == ["bad", "good", "slow"]  # each run once
    assert names("quickstart") == []  # a folder, not the name
    assert names("--output-dir", str(out), "slow") == ["slow"]  # a NAME, as before
    usage_error(cli("runs", "elsewhere/nosuch"), "elsewhere/nosuch: no such folder")


def test_listing_runs_does_not_import_torch(runs: tuple[Path, dict]) -> None:
    out, _ = runs
    check = (
        "import sys\nfrom launcher.cli.app import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('torch imported' if 'torch' in sys.modules else 'no torch')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", check, "runs", "--output-dir", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "no torch", result.stdout


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@needs_matplotlib
def test_plot_writes_a_png_of_every_run(runs: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = runs
    rows = listed(out)
    png = tmp_path / "curves.png"
    folders = [rows["good"]["folder"], rows["slow"]["folder"]]
    result = cli("plot", *folders, "--metric", "loss,val/loss", "--metric", "lr", "--out", str(png))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"wrote {png}\n"  # the result, on stdout
    # Two panels: loss with val/loss, and lr.
    assert _png_size(png) == (round(FIGURE_WIDTH * DPI), round(2 * PANEL_HEIGHT * DPI))
    by_time = cli("plot", folders[0], "--x", "time", "--out", str(png))
    assert by_time.returncode == 0, by_time.stderr
    assert _png_size(png) == (round(FIGURE_WIDTH * DPI), round(PANEL_HEIGHT * DPI))


@needs_plotext
def test_plot_in_the_terminal(runs: tuple[Path, dict]) -> None:
    out, _ = runs
    result = cli("plot", listed(out, "good")["good"]["folder"], env={"COLUMNS": "90"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) >= 10 and "val/loss" in result.stdout and "step" in result.stdout
    assert max(map(len, lines)) <= 90
    assert "\x1b[" not in result.stdout  # not a terminal: no colour codes


def test_plot_refuses_a_missing_metric_a_folder_and_a_missing_package(
    runs: tuple[Path, dict], tmp_path: Path
) -> None:
    out, _ = runs
    folder = listed(out, "bad")["bad"]["folder"]
    usage_error(cli("plot", folder, "--metric", "val/loss"), "--metric val/loss", "Available: ")
    usage_error(cli("plot", folder, str(tmp_path)), f"{tmp_path}: not a run folder")
    for package in ("matplotlib", "plotext"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("raise ImportError('not here')\n")
    blocked = {"PYTHONPATH": str(tmp_path)}
    usage_error(cli("plot", folder, "--out", str(tmp_path / "x.png"), env=blocked), "[viz]")
    usage_error(cli("plot", folder, env=blocked), "plotext")


def _hostile_copies(good: Path, top: Path) -> Path:
    """Copies of a finished run, each with what a run (or anyone who can write into runs/)
    may leave: NaN, Infinity and huge numbers in its metrics, an outcome with an infinite
    exit code, escape codes and rich markup in folder names and reasons, a FIFO and
    /dev/zero for a metrics file and a progress file, and a link to a run beside it."""
    runs = top / "runs" / "good"
    runs.mkdir(parents=True)
    numbers = shutil.copytree(good, runs / "[ablation]run1")
    with (numbers / "metrics.jsonl").open("a") as f:
        f.write('{"step": 9, "loss": NaN}\n{"step": 10, "loss": Infinity}\n')
        f.write('{"step": 11, "loss": ' + "9" * 400 + "}\n")
    escapes = shutil.copytree(good, runs / "\x1b]8;;evil.example\x07esc\x1b[2J")
    (escapes / "outcome.json").write_text(
        json.dumps({"status": "stopped", "exit_code": 143, "ended": 2e9, "reason": "\x1b[2Jx"})
    )
    infinite = shutil.copytree(good, runs / "infinite")
    (infinite / "outcome.json").write_text('{"status": "failed", "exit_code": 1e999, "ended": 1}')
    fifo = shutil.copytree(good, runs / "fifo")
    zero = shutil.copytree(good, runs / "zero")
    for name in ("metrics.jsonl", "progress.json"):  # what `train runs` reads, and its fallback
        (fifo / name).unlink()
        os.mkfifo(fifo / name)
        (zero / name).unlink()
        (zero / name).symlink_to("/dev/zero")
    (runs / "link").symlink_to(numbers)
    return numbers


def test_runs_and_plot_survive_what_a_run_folder_may_hold(
    runs: tuple[Path, dict], tmp_path: Path
) -> None:
    out, _ = runs
    good = listed(out, "good")["good"]
    numbers = _hostile_copies(Path(good["folder"]), tmp_path)
    table = cli("runs", "--output-dir", str(tmp_path / "runs"))
    assert table.returncode == 0, table.stdout + table.stderr
    assert "\x1b" not in table.stdout + table.stderr
    assert "[ablation]run1" in table.stdout  # shown as named, not taken for markup
    assert table.stdout.count("[ablation]run1") == 1  # the link is no second run
    rows = json.loads(cli("runs", "--output-dir", str(tmp_path / "runs"), "--json").stdout)
    by_folder = {Path(row["folder"]).name: row for row in rows}
    assert len(rows) == 5 and "link" not in by_folder, sorted(by_folder)
    assert by_folder["[ablation]run1"]["last_loss"] == good["last_loss"]  # the last finite one
    assert by_folder["infinite"]["status"] == "interrupted"  # its record cannot be read
    assert by_folder["fifo"]["last_loss"] is None and by_folder["zero"]["last_loss"] is None
    bad_metric = cli("plot", str(numbers), "--metric", "\x1b[2Jnope")
    usage_error(bad_metric, "--metric \\x1b[2Jnope: no such metric")
    assert "\x1b" not in bad_metric.stderr
    if importlib.util.find_spec("plotext") is not None:
        drawn = cli("plot", str(numbers))
        assert drawn.returncode == 0, drawn.stderr  # NaN, Infinity and 10**400 left out


def test_plot_draws_a_loss_of_plus_and_minus_1e308(runs: tuple[Path, dict], tmp_path: Path) -> None:
    """Both are finite, but the axis between them spans more than a float holds: matplotlib
    and plotext failed with a traceback. They are marked as values with no height."""
    out, _ = runs
    huge = shutil.copytree(listed(out, "good")["good"]["folder"], tmp_path / "huge")
    with (huge / "metrics.jsonl").open("a") as f:
        f.write('{"step": 11, "loss": 1e308}\n{"step": 12, "loss": -1e308}\n')
        f.write('{"step": 13, "loss": 1e300}\n{"step": 14, "loss": -1e300}\n')  # still drawn
    for package, args in (("plotext", []), ("matplotlib", ["--out", str(tmp_path / "c.png")])):
        if importlib.util.find_spec(package) is None:
            continue
        drawn = cli("plot", str(huge), *args)
        assert drawn.returncode == 0, drawn.stdout + drawn.stderr
        if package == "plotext":
            assert "beyond ±1e300) at step 11, 12\n" in drawn.stdout, drawn.stdout


# --- runs whose checkpoints are in a store (checkpoint.dir: s3://...) -----------------------


def _stored_run(output_dir: Path, name: str, url: str, **options: str) -> Path:
    """A run folder as a launcher leaves one whose checkpoints go to the store `url`: its spec
    and its record of the store (with `options`, a storage_options the spec gave)."""
    from launcher.checkpoint.store import record_store
    from launcher.storage_url import location

    run = output_dir / name / "r1"
    run.mkdir(parents=True)
    write_spec(run / "spec.yaml", run={"name": name, "output_dir": str(output_dir)})
    record_store(run, location(url, options))
    return run


def _fake_credentials(endpoint: str) -> dict[str, str]:
    """What a user's environment holds for a store; none of this machine's own."""
    return {
        "AWS_ACCESS_KEY_ID": "key",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        "AWS_CONFIG_FILE": "/nonexistent",
    }


def test_a_store_that_cannot_be_reached_is_named_with_its_reason(tmp_path: Path) -> None:
    """Its run's checkpoint was `-`, like a run with none, with no word why; and each such run
    held `train runs` up some 10 s while the client tried the closed port again."""
    from tests.s3_server import BUCKET, s3_server

    out = tmp_path / "runs"
    closed = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    _stored_run(out, "lost", f"s3://{BUCKET}/lost", endpoint_url=closed)
    _stored_run(out, "kept", f"s3://{BUCKET}/kept")
    for server in s3_server():
        server.filesystem().pipe(f"{BUCKET}/kept/step-00000004/COMPLETE", b"")
        table = cli("runs", "--output-dir", str(out), env=server.env)
        rows = {row["name"]: row for row in json.loads(cli(
            "runs", "--output-dir", str(out), "--json", env=server.env).stdout)}  # fmt: skip
    assert table.returncode == 0, table.stdout + table.stderr
    cells = {line.split()[0]: line.split()[7] for line in table.stdout.splitlines()[1:3]}
    assert cells == {"kept": "4", "lost": "?"}, table.stdout
    said = f"? checkpoints in s3://{BUCKET}/lost could not be listed: the endpoint is unreachable"
    assert said in table.stdout, table.stdout
    assert f'{closed}/{BUCKET}")' in table.stdout  # the client's words, less the query string
    assert rows["lost"]["checkpoint"] is None
    assert rows["lost"]["checkpoint_store_error"].startswith("the endpoint is unreachable")
    assert rows["kept"]["checkpoint_step"] == 4 and rows["kept"]["checkpoint_store_error"] is None


@pytest.mark.timeout(90)
def test_a_store_that_never_answers_holds_the_listing_up_for_seconds(tmp_path: Path) -> None:
    """An endpoint that takes connections and says nothing: S3's client waits a minute for
    each request, and tries again; `train runs` waited that for every run of the store."""
    from launcher.runs.store_listing import STORE_WAIT_S

    out = tmp_path / "runs"
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel completes the connections; nobody reads them
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        for name in ("a", "b", "c"):
            _stored_run(out, name, f"s3://bucket/{name}")
        started = time.monotonic()
        table = cli("runs", "--output-dir", str(out), env=_fake_credentials(endpoint))
        took = time.monotonic() - started
    assert table.returncode == 0, table.stdout + table.stderr
    # The wait and a Python process's start, with room for a loaded machine; without the
    # wait, the client's own read timeout alone is a minute.
    assert took < STORE_WAIT_S + 35, took
    said = f"? checkpoints in s3://bucket/a (and 2 more) could not be listed: no answer within {STORE_WAIT_S:g} s"
    assert said in table.stdout, table.stdout

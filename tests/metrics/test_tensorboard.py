"""TensorBoard event files: our writer's files read back by TensorBoard's own reader; rank 0
alone writes them during a real run; the older `log.tensorboard: false` still turns them off;
and the metrics
sinks' background writer never holds up a step, nor fails a run when a sink fails."""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest

from launcher.metrics.sinks import BackgroundWriter
from launcher.metrics.tensorboard_events import (
    DamagedEventFile,
    EventWriter,
    crc32c,
    encode_event,
    frame,
    masked_crc32c,
    read_scalars,
)
from launcher.metrics.trackers.tensorboard import TensorBoardSink, scalar_tags
from launcher.rundir.layout import RunLayout
from launcher.rundir.reading import UnreadableFile
from tests.conftest import only_run_dir, run_train, write_spec

pytestmark = pytest.mark.launcher_only

SCALARS = {
    -1: {"train/big": 1e39},  # a negative int64, and beyond float32's range: stored as inf
    5: {"train/loss": 1.25, "train/lr": 0.001},
    10: {"train/loss": 0.5, "val/loss": 0.75, "train/lr": 3e-4},
}


def _write(directory: Path) -> Path:
    with closing(EventWriter(directory)) as writer:
        for step, scalars in SCALARS.items():
            writer.add_scalars(step, scalars, wall_time=1000.0 + step)
    return writer.path


def _expected() -> list[tuple[int, str, float]]:
    def f32(v: float) -> float:
        return float("inf") if v > 3.5e38 else struct.unpack("<f", struct.pack("<f", v))[0]

    return [(s, tag, f32(v)) for s, scalars in SCALARS.items() for tag, v in scalars.items()]


def test_crc32c_matches_the_known_vectors() -> None:
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720, B.4
    assert crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E


def test_records_are_framed_and_checked() -> None:
    data = encode_event(1.5, 3, {"a": 1.0})
    record = frame(data)
    assert struct.unpack("<Q", record[:8]) == (len(data),)
    assert struct.unpack("<I", record[8:12]) == (masked_crc32c(record[:8]),)
    assert record[12:-4] == data
    assert struct.unpack("<I", record[-4:]) == (masked_crc32c(data),)


def tensorboards_scalars(path: Path) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in one event file, by TensorBoard's own reader."""
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    ).EventAccumulator
    events = accumulator(str(path))
    events.Reload()
    found = [
        (e.step, tag, e.value) for tag in events.Tags()["scalars"] for e in events.Scalars(tag)
    ]
    return sorted(found)


def _files(directory: Path) -> list[Path]:
    return sorted(directory.glob("events.out.tfevents.*"))


def test_a_second_writer_gets_a_file_of_its_own(tmp_path: Path) -> None:
    first, second = _write(tmp_path / "tb"), _write(tmp_path / "tb")
    assert first != second and _files(tmp_path / "tb") == sorted([first, second])
    assert read_scalars(first) == read_scalars(second) == sorted(_expected())


def test_our_reader_reads_what_tensorboards_reader_reads(tmp_path: Path) -> None:
    """`read_scalars` against TensorBoard's own reader, on our writer's file and on one that
    torch's `SummaryWriter` (TensorBoard's protobuf classes) wrote."""
    ours = _write(tmp_path / "ours")
    assert read_scalars(ours) == tensorboards_scalars(ours) == sorted(_expected())
    summary_writer = pytest.importorskip("torch.utils.tensorboard").SummaryWriter
    with closing(summary_writer(str(tmp_path / "torch"))) as writer:
        for step, scalars in SCALARS.items():
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, step)
    [theirs] = _files(tmp_path / "torch")
    assert read_scalars(theirs) == tensorboards_scalars(theirs) == sorted(_expected())


def test_a_folders_files_are_read_together_and_a_cut_record_left_out(tmp_path: Path) -> None:
    first, second = _write(tmp_path / "tb"), _write(tmp_path / "tb")
    assert read_scalars(tmp_path / "tb") == sorted(_expected() * 2)
    whole = second.read_bytes()
    second.write_bytes(whole[:-5])  # a run killed in its last write: the last event is lost
    last_step = max(SCALARS)
    assert read_scalars(second) == [s for s in sorted(_expected()) if s[0] != last_step]
    damaged = bytearray(whole)
    damaged[-6] ^= 0xFF
    second.write_bytes(bytes(damaged))
    with pytest.raises(DamagedEventFile, match="fails its checksum"):
        read_scalars(second)
    with pytest.raises(FileNotFoundError):
        read_scalars(tmp_path / "missing")
    os.mkfifo(tmp_path / "fifo")  # opened for reading, it would wait for a writer
    with pytest.raises(UnreadableFile, match="fifo: not a regular file"):
        read_scalars(tmp_path / "fifo")
    assert first.exists()


def test_tensorboard_reads_what_our_writer_wrote(tmp_path: Path) -> None:
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    ).EventAccumulator
    _write(tmp_path / "tb")
    events = accumulator(str(tmp_path / "tb"))
    events.Reload()
    assert events.file_version == 2.0
    assert sorted(events.Tags()["scalars"]) == ["train/big", "train/loss", "train/lr", "val/loss"]
    got = [(e.step, tag, e.value) for tag in events.Tags()["scalars"] for e in events.Scalars(tag)]
    assert sorted(got) == sorted(_expected())
    assert [e.wall_time for e in events.Scalars("train/loss")] == [1005.0, 1010.0]


def test_metrics_records_map_to_tags() -> None:
    train = {"step": 4, "epoch": 0, "lr": 0.1, "samples_per_s": 80, "loss": 0.5, "time": 1.0}
    assert scalar_tags({**train, "mfu": None, "note": "x", "flag": True}) == {
        "train/lr": 0.1,
        "train/samples_per_s": 80.0,
        "train/loss": 0.5,
    }
    evaluation = {"step": 4, "epoch": 0, "eval_s": 0.25, "val/loss": 0.7, "time": 1.0}
    assert scalar_tags(evaluation) == {"val/eval_s": 0.25, "val/loss": 0.7}


class _StuckWriter(EventWriter):
    """A disk that hangs on every write until the test lets it go."""

    go = threading.Event()

    def add_scalars(self, *args: object, **kwargs: object) -> None:
        self.go.wait(timeout=30)
        super().add_scalars(*args, **kwargs)  # type: ignore[arg-type]


def _records(n: int) -> list[dict]:
    return [{"step": s, "loss": 1.0 / s, "time": 1000.0 + s} for s in range(1, n + 1)]


@pytest.mark.timeout(60)
def test_a_slow_disk_never_holds_up_a_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _StuckWriter.go.clear()
    sinks = BackgroundWriter([TensorBoardSink(tmp_path / "tb", writer=_StuckWriter)])
    started = time.monotonic()
    for record in _records(100):
        sinks.write(record)
    assert time.monotonic() - started < 1.0  # a logic check: one write would take 30 s
    _StuckWriter.go.set()
    sinks.close()
    [events] = _files(tmp_path / "tb")
    assert [s for s, _, _ in read_scalars(events)] == list(range(1, 101))
    assert capsys.readouterr().err == ""


@pytest.mark.timeout(60)
def test_a_full_queue_drops_records_and_a_stuck_close_gives_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _StuckWriter.go.clear()
    sink = TensorBoardSink(tmp_path / "tb", writer=_StuckWriter)
    sinks = BackgroundWriter([sink], capacity=5, close_timeout=0.5)
    started = time.monotonic()
    for record in _records(50):
        sinks.write(record)
    sinks.close()
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert err.count("5 records wait for tensorboard; dropping the oldest ones") == 1, err
    assert err.count("tensorboard still writing after 0.5 s") == 1, err
    _StuckWriter.go.set()  # lets the daemon thread finish


class _BrokenWriter(EventWriter):
    def add_scalars(self, *args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")


@pytest.mark.timeout(60)
def test_a_failing_disk_warns_once_and_the_run_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    healthy = _Kept()
    sinks = BackgroundWriter([TensorBoardSink(tmp_path / "tb", writer=_BrokenWriter), healthy])
    for record in _records(20):
        sinks.write(record)
        time.sleep(0.01)
    sinks.close()
    err = capsys.readouterr().err
    assert err.count("WARNING: tensorboard: could not write") == 1, err
    assert "No space left on device" in err
    assert "training goes on" in err
    assert [r["step"] for r in healthy.records] == list(range(1, 21))  # the others go on
    assert healthy.closed


class _Kept:
    """A sink that keeps what it gets."""

    name, where = "kept", "memory"

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.closed = False

    def start(self) -> None:
        pass

    def write(self, record: dict) -> None:
        self.records.append(record)

    def flush(self) -> None:
        pass

    def end(self, outcome: object) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@pytest.mark.timeout(300)
def test_rank_0_alone_writes_the_metrics_of_a_run(tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path / "run.yaml",
        train={"max_steps": 6, "log_every": 2},
        eval={"every_n_steps": 3},
        checkpoint={"enabled": False},
    )
    result = run_train(["--config", str(spec)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run_dir(tmp_path / "runs")
    files = list(RunLayout(run).tensorboard_dir.iterdir())
    assert len(files) == 1, files
    assert files[0].name.startswith("events.out.tfevents.")
    got: dict[str, dict[int, float]] = {}
    for step, tag, value in read_scalars(files[0]):
        got.setdefault(tag, {})[step] = value
    assert sorted(got["train/loss"]) == [2, 4, 6]
    assert sorted(got["val/loss"]) == [3, 6]
    assert {"train/lr", "train/samples_per_s", "val/mae", "val/eval_s"} <= set(got)
    # The same numbers as metrics.jsonl, to float32's precision.
    for line in RunLayout(run).metrics.read_text().splitlines():
        record = json.loads(line)
        for tag, value in scalar_tags(record).items():
            assert got[tag][record["step"]] == pytest.approx(value, rel=1e-6)


def test_the_older_log_tensorboard_key_still_turns_it_off_or_on() -> None:
    """Runs written before `log.trackers` keep `log.tensorboard` in their spec.yaml, which
    `train runs` and a resume read. (tests/metrics/test_trackers.py runs without it.)"""
    from launcher.config.log import LogSection

    assert LogSection.model_validate({"tensorboard": False}).trackers == []
    both = LogSection.model_validate({"tensorboard": True, "trackers": ["csv"]})
    assert both.trackers == ["tensorboard", "csv"]
    assert LogSection.model_validate({}).trackers == ["tensorboard"]

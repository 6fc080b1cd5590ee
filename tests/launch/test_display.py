import io
import json
import random
import re
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

import launcher.launch.display.console as display_console
import launcher.launch.display.sinks as display_sinks
from launcher.launch.display import RunDisplay
from launcher.launch.display.alerts import AlertDetector, looks_like_alert, may_hold_alerts
from launcher.launch.display.coalesce import Coalescer
from launcher.launch.display.lines import format_line
from launcher.launch.display.status import TelemetryBoard, format_elapsed, parse_telemetry
from launcher.launch.display.tail import CUT, MAX_PENDING_BYTES, FileTail, MultiTail
from launcher.safe_text import clean

# -- tailing ---------------------------------------------------------------------------


def append(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def test_tail_waits_for_a_late_file_and_holds_back_partial_lines(tmp_path):
    path = tmp_path / "logs" / "rank-0.log"
    tail = FileTail(path)
    assert tail.read_lines() == []
    append(path, "one\ntw")
    assert tail.read_lines() == ["one"]
    assert tail.read_lines() == []
    append(path, "o\nthree")
    assert tail.read_lines() == ["two"]
    assert tail.flush() == ["three"]
    assert tail.flush() == []


def test_tail_decodes_like_a_terminal(tmp_path):
    path = tmp_path / "rank-0.log"
    tail = FileTail(path)
    append(path, b"bad \xff\xfe bytes\r\ncaf\xc3")  # "é" split across two writes
    assert tail.read_lines() == ["bad \ufffd\ufffd bytes"]
    append(path, b"\xa9\n 10%\r 50%\r100%\n  spaces kept  \n")
    assert tail.read_lines() == ["café", "100%", "  spaces kept  "]


def test_a_line_too_long_to_hold_is_shown_in_pieces_marked_as_cut(tmp_path):
    """20 MiB without a newline: pieces, each marked; its end marked as never ended."""
    path = tmp_path / "rank-0.log"
    tail = FileTail(path)
    append(path, b"x" * (20 << 20))
    pieces = []
    while lines := tail.read_lines():
        pieces += lines
    last = tail.flush()
    assert len(pieces) >= 2 and all(p.endswith(CUT.decode()) for p in pieces)
    assert last == ["x" * (MAX_PENDING_BYTES // 2)]  # then marked [no newline] on screen
    shown = sum(len(p) - len(CUT) for p in pieces) + len(last[0])
    assert shown == 20 << 20  # every byte, once
    append(path, b"redrawn\r" * 300_000 + b"done\n")  # a progress bar: its newest state
    assert all(not line.endswith(CUT.decode()) for line in tail.read_lines() + tail.flush())


def test_tail_from_end_skips_what_an_earlier_run_left(tmp_path):
    path = tmp_path / "rank-0.log"
    append(path, "old run\n")
    tail = FileTail(path, from_end=True)
    append(path, "new run\n")
    assert tail.read_lines() == ["new run"]


def test_tail_starts_over_when_the_file_is_replaced(tmp_path):
    path = tmp_path / "rank-0.log"
    tail = FileTail(path)
    append(path, "first file\nhalf")
    assert tail.read_lines() == ["first file"]
    path.unlink()
    append(path, "second\n")
    assert tail.read_lines() == ["second"]


def test_multi_tail_returns_lines_per_key_in_key_order(tmp_path):
    paths = {rank: tmp_path / f"rank-{rank}.log" for rank in (0, 1)}
    tails = MultiTail(paths)
    append(paths[1], "b1\nb2\n")
    append(paths[0], "a1\na2")
    assert tails.poll() == [(0, "a1"), (1, "b1"), (1, "b2")]
    assert tails.flush() == [(0, "a2")]


# -- alerts ----------------------------------------------------------------------------


ALERTS = [
    "/data/x.py:3: UserWarning: TypedStorage is deprecated",
    "WARNING:root:slow step",
    "2024-01-01 ERROR lost connection",
    "RuntimeError: CUDA error: device-side assert triggered",
    "train.py: error: unrecognized arguments",
    "Fatal Python error: Segmentation fault",
    "Segmentation fault (core dumped)",
    "node1:123:456 [0] NCCL WARN Call to connect returned Connection refused",
    "NCCL error in: ProcessGroupNCCL.cpp:1234, unhandled system error",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer",
    "[W socket.cpp:663] [c10d] The client socket has failed to connect",
    "E1121 10:28:00.123000 123 torch/distributed/elastic/agent.py:1] failed",
    "KeyboardInterrupt",
]


@pytest.mark.parametrize("line", ALERTS)
def test_warnings_and_errors_are_alerts(line):
    assert looks_like_alert(line)


@pytest.mark.parametrize(
    "line",
    [
        "step 10/200 loss 0.53",
        "loading data [1/2] from /tmp/errors",
        "error_rate=0.01 no errors",
        "Warm-up done",
        "",
    ],
)
def test_ordinary_lines_are_not_alerts(line):
    assert not looks_like_alert(line)


CHAINED_TRACEBACK = [
    ("step 3", False),
    ("Traceback (most recent call last):", True),
    ('  File "train.py", line 3, in <module>', True),
    ("    step([batch])", True),
    ("    ~~~~^^^^^^^^^", True),
    ("StopIteration: done", True),
    ("", True),
    ("During handling of the above exception, another exception occurred:", True),
    ("", True),
    ("Traceback (most recent call last):", True),
    ('  File "train.py", line 5, in <module>', True),
    ("CustomFailure: [shape] mismatch", True),
    ("after the block", False),
    ("  indented but ordinary", False),
]


def test_a_chained_traceback_is_one_alert_block():
    detector = AlertDetector()
    assert [(line, detector.is_alert(0, line)) for line, _ in CHAINED_TRACEBACK] == (
        CHAINED_TRACEBACK
    )


def test_traceback_state_is_per_rank():
    detector = AlertDetector()
    assert detector.is_alert(0, "Traceback (most recent call last):")
    assert not detector.is_alert(1, "  ordinary indented line of rank 1")
    assert detector.is_alert(0, '  File "x.py", line 1, in f')
    assert not detector.is_alert(1, "Done")
    assert detector.is_alert(0, "Done")  # flush-left: rank 0's exception line
    assert not detector.is_alert(0, "next")


# -- coalescing ------------------------------------------------------------------------


def test_identical_lines_within_the_window_merge():
    lines = Coalescer(window_s=0.2)
    lines.add(0, "loading", now=0.0)
    lines.add(1, "loading", now=0.1)
    assert lines.ready(now=0.19) == []
    assert lines.ready(now=0.2) == [(frozenset({0, 1}), "loading")]
    assert lines.flush() == []


def test_identical_lines_outside_the_window_stay_apart():
    lines = Coalescer(window_s=0.2)
    lines.add(0, "loading", now=0.0)
    assert lines.ready(now=0.25) == [(frozenset({0}), "loading")]
    lines.add(1, "loading", now=0.25)
    assert lines.ready(now=1.0) == [(frozenset({1}), "loading")]


def test_a_late_read_does_not_shorten_the_window():
    """The files were read again only 0.3 s after the first copy (the display's thread
    waited for a core): what that read brought was written within the window, so it joins."""
    lines = Coalescer(window_s=0.2)
    lines.add(0, "loading", now=0.0)
    assert lines.ready(now=0.1) == []
    lines.add(1, "loading", now=0.3)
    assert lines.ready(now=0.3) == [(frozenset({0, 1}), "loading")]


def test_a_rank_repeating_itself_gives_two_lines():
    lines = Coalescer(window_s=0.2)
    for rank, now in ((0, 0.0), (0, 0.01), (1, 0.02), (1, 0.03), (2, 0.04)):
        lines.add(rank, "tick", now=now)
    assert lines.flush() == [(frozenset({0, 1, 2}), "tick"), (frozenset({0, 1}), "tick")]


def test_merging_never_reorders_a_ranks_own_lines():
    lines = Coalescer(window_s=0.2)
    lines.add(0, "x", now=0.0)
    lines.add(0, "y", now=0.0)
    lines.add(1, "y", now=0.05)
    lines.add(1, "x", now=0.05)  # rank 1 printed y first, so it cannot join the earlier x
    assert lines.ready(now=0.3) == [
        (frozenset({0}), "x"),
        (frozenset({0, 1}), "y"),
        (frozenset({1}), "x"),
    ]


def test_a_ranks_own_line_read_after_another_ranks_copy_does_not_split_the_copies():
    """torch 2.9 prints `[Gloo] Rank N is connected ...` on every rank as a group starts,
    right before the header every rank prints: one read brings rank 0's two lines, then
    rank 1's. Rank 1's own line moves before rank 0's header, so its header joins it."""
    lines = Coalescer(window_s=0.2, expected=[0, 1])
    for rank in (0, 1):
        lines.add(rank, f"[Gloo] Rank {rank} is connected", now=0.0)
        lines.add(rank, "5,313 parameters", now=0.0)
        lines.add(rank, f"process {rank}/2", now=0.0)
    assert lines.flush() == [
        (frozenset({0}), "[Gloo] Rank 0 is connected"),
        (frozenset({1}), "[Gloo] Rank 1 is connected"),
        (frozenset({0, 1}), "5,313 parameters"),
        (frozenset({0}), "process 0/2"),
        (frozenset({1}), "process 1/2"),
    ]


def test_folding_keeps_every_ranks_lines_in_their_order():
    """Three ranks print lines from a small set, read in random bursts: whatever folds, each
    rank's lines come out whole and in the order it printed them."""
    rng = random.Random(0)
    for _ in range(300):
        lines, printed, shown = Coalescer(window_s=0.2), {0: [], 1: [], 2: []}, []
        now = 0.0
        for _ in range(rng.randrange(1, 40)):
            rank, text = rng.randrange(3), rng.choice("abcd")
            printed[rank].append(text)
            lines.add(rank, text, now=now)
            if rng.random() < 0.2:
                now += rng.choice((0.05, 0.3))
                shown += lines.ready(now=now)
        shown += lines.flush()
        for rank, texts in printed.items():
            assert [text for ranks, text in shown if rank in ranks] == texts


def test_a_line_every_expected_rank_printed_goes_at_once_but_in_order():
    lines = Coalescer(window_s=0.2, expected=[0, 1])
    lines.add(0, "a", now=0.0)
    lines.add(1, "a", now=0.0)
    assert lines.ready(now=0.0) == [(frozenset({0, 1}), "a")]
    lines.add(0, "b", now=0.0)
    lines.add(0, "c", now=0.0)
    lines.add(1, "c", now=0.0)
    assert lines.ready(now=0.1) == []  # "c" is complete but must not overtake "b"
    assert lines.ready(now=0.2) == [(frozenset({0}), "b"), (frozenset({0, 1}), "c")]


# -- line format and telemetry ---------------------------------------------------------


def render(renderable, terminal=False, width=60) -> str:
    out = io.StringIO()
    Console(file=out, force_terminal=terminal, width=width).print(renderable, soft_wrap=True)
    return out.getvalue()


def test_format_line_keeps_text_verbatim():
    assert render(format_line([3], "[red]x[/red] :smile:")) == "[rank 3] [red]x[/red] :smile:\n"
    assert render(format_line([0, 1, 2, 5], "\x1b[31mred\x1b[0m")) == "[ranks 0-2,5] red\n"
    coloured = render(format_line([1], "[b]"), terminal=True)
    assert coloured == "\x1b[35m[rank 1] \x1b[0m[b]\n"


def test_parse_telemetry_is_tolerant():
    line = '{"rank": 0, "step": 12, "loss": 0.5, "attempt": true, "note": "x", "max_steps": "?"}'
    assert parse_telemetry(line) == {"step": 12, "loss": 0.5}
    assert parse_telemetry('{"step": 1') == {}
    assert parse_telemetry("[1, 2]") == {}
    assert parse_telemetry("") == {}


def test_telemetry_board_renders_one_row_per_rank():
    board = TelemetryBoard([0, 1, 2])
    board.update(0, '{"step": 5, "max_steps": 200, "loss": 9.9, "elapsed_s": 1.0}')
    full = '{"step": 12, "max_steps": 200, "loss": 0.53, "samples_per_s": 1234.5, "elapsed_s": 3.2}'
    assert board.update(0, full)
    assert not board.update(1, "not json")
    assert board.update(1, '{"step": 7, "loss": 1.25, "samples_per_s": 12.34, "elapsed_s": 3725}')
    lines = [line.rstrip() for line in render(board.render("demo")).splitlines()]
    assert lines == [
        "demo",
        " rank     step   loss   samples/s   elapsed",
        "─" * 44,
        "    0   12/200   0.53       1,234      3.2s",
        "    1        7   1.25        12.3   1:02:05",
        "    2        -      -           -         -",
    ]


def test_telemetry_board_summarizes_ranks_beyond_the_row_limit():
    board = TelemetryBoard(range(20))
    for rank in range(20):
        board.update(rank, json.dumps({"step": 10 + rank, "max_steps": 50, "loss": rank}))
    lines = render(board.render()).splitlines()
    assert len(lines) == 2 + 16
    assert lines[-2].split() == ["14", "24/50", "14", "-", "-"]
    assert lines[-1].split() == ["15-19", "25/50", "17", "-", "-"]


def test_format_elapsed():
    assert [format_elapsed(s) for s in (None, 3.21, 59.9, 245, 3723)] == [
        "-",
        "3.2s",
        "59.9s",
        "4:05",
        "1:02:03",
    ]


# -- RunDisplay end to end -------------------------------------------------------------


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the display"
        time.sleep(0.02)


def wait_for(out: io.StringIO, text: str) -> None:
    wait_until(lambda: text in out.getvalue())


def plain_display(run_dir: Path, **kwargs) -> tuple[RunDisplay, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=40)
    return RunDisplay(run_dir, [0, 1], console=console, **kwargs), out


@pytest.mark.timeout(30)
def test_run_display_prints_plain_prefixed_merged_unwrapped_lines(tmp_path):
    logs = tmp_path / "logs"
    long_line = "long " + "x" * 95
    display, out = plain_display(tmp_path, coalesce_window_s=1.0)
    with display:
        append(logs / "rank-0.log", "hello [world]\n")
        append(logs / "rank-1.log", "hello [world]\n")
        wait_for(out, "hello [world]\n")
        append(logs / "rank-0.log", long_line + "\n")
        wait_for(out, long_line)
        append(logs / "rank-1.log", "[1/2] [bold]not markup[/bold]\nno newline yet")
        wait_for(out, "[/bold]\n")
    display.stop()  # idempotent
    assert "\x1b" not in out.getvalue()
    assert out.getvalue().splitlines() == [
        "[ranks 0-1] hello [world]",
        f"[rank 0] {long_line}",
        "[rank 1] [1/2] [bold]not markup[/bold]",
        "[rank 1] no newline yet [no newline]",
    ]


@pytest.mark.timeout(30)
def test_ranks_filter_hides_ordinary_lines_but_not_tracebacks(tmp_path):
    logs = tmp_path / "logs"
    append(logs / "rank-0.log", "an earlier run's line\n")
    display, out = plain_display(tmp_path, show=frozenset({0}))
    with display:
        append(
            logs / "rank-1.log",
            "ordinary line\n"
            "Traceback (most recent call last):\n"
            '  File "train.py", line 3, in <module>\n'
            "    step([batch])\n"
            "ValueError: bad [shape]\n"
            "after the traceback\n",
        )
        wait_for(out, "ValueError")
        append(logs / "rank-0.log", "rank zero\n")
        append(logs / "rank-1.log", "rank one\n")
        wait_for(out, "rank zero")
    assert out.getvalue().splitlines() == [
        "[rank 1] Traceback (most recent call last):",
        '[rank 1]   File "train.py", line 3, in <module>',
        "[rank 1]     step([batch])",
        "[rank 1] ValueError: bad [shape]",
        "[rank 0] rank zero",
    ]


@pytest.mark.timeout(30)
def test_display_errors_are_reported_once_and_the_display_goes_on(tmp_path, monkeypatch):
    calls = []

    def fail_on_lost(text, keep_sgr=False):
        calls.append(text)
        if text.startswith("lost"):
            raise RuntimeError(f"boom {text}")
        return clean(text, keep_sgr)

    monkeypatch.setattr(display_sinks, "clean", fail_on_lost)
    display, out = plain_display(tmp_path, show=frozenset({0}))
    log = tmp_path / "logs" / "rank-0.log"
    with display:
        append(log, "lost 1\n")
        wait_for(out, "boom")
        append(log, "lost 2\n")
        wait_until(lambda: "lost 2" in calls)
        append(log, "kept\n")
        wait_for(out, "kept")
    assert out.getvalue().splitlines() == [
        "launcher display error (the run continues): RuntimeError('boom lost 1')",
        "[rank 0] kept",
    ]


@pytest.mark.timeout(30)
def test_run_display_on_a_terminal_shows_telemetry_and_stops_cleanly(tmp_path):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=80)
    stdout = sys.stdout
    display = RunDisplay(tmp_path, [0, 1], console=console, title="quickstart")
    display.start()
    record = {"rank": 0, "step": 12, "max_steps": 200, "loss": 0.53, "samples_per_s": 1234.5}
    append(tmp_path / "telemetry" / "rank-0.jsonl", json.dumps(record) + '\n{"step": 13, "lo')
    append(tmp_path / "logs" / "rank-0.log", "step 12\n")
    wait_for(out, "12/200")
    wait_for(out, "step 12\n")
    display.stop()
    display.stop()
    final = out.getvalue()
    assert "\x1b[36m[rank 0] \x1b[0mstep 12\n" in final
    assert "quickstart" in final
    # Live leaves its last frame: the half-written record never replaced the full one.
    last_row = [line for line in final.splitlines() if "12/200" in line][-1]
    assert "0.53" in last_row and "1,234" in last_row
    assert final.endswith("\x1b[?25h")  # cursor shown again
    assert sys.stdout is stdout


def shown_on_a_terminal(run_dir: Path, rank: int, lines: list[str]) -> str:
    """What a terminal shows of `lines` printed at once by `rank`, without escape codes."""
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200)
    with RunDisplay(run_dir, [rank], console=console):
        append(run_dir / "logs" / f"rank-{rank}.log", "".join(line + "\n" for line in lines))
        wait_for(out, lines[-1])
    return re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", out.getvalue())


@pytest.mark.timeout(30)
def test_a_terminal_folds_a_burst_but_never_its_alerts(tmp_path):
    log = tmp_path / "logs" / "rank-1.log"
    burst = [f"line {i}" for i in range(5000)]
    burst[2500:2500] = [
        "Traceback (most recent call last):",
        '  File "x.py", line 1',
        "OSError: disk",
    ]
    text = shown_on_a_terminal(tmp_path, 1, burst)
    assert "[rank 1] line 0\n" in text and "[rank 1] line 4999\n" in text
    assert f"[rank 1] ... {5000 - 40:,} more lines (see {log})" in text
    assert '[rank 1]   File "x.py", line 1\n[rank 1] OSError: disk\n' in text
    assert "[rank 1] line 2500\n" not in text


@pytest.mark.timeout(30)
def test_a_terminal_never_folds_away_a_traceback_that_began_before_the_fold(tmp_path):
    burst = [f"line {i}" for i in range(5000)]
    frames = [f'  File "x.py", line {i}' for i in range(30)]
    burst[10:10] = ["Traceback (most recent call last):", *frames, "OSError: disk"]
    text = shown_on_a_terminal(tmp_path, 0, burst)
    for line in [*frames, "OSError: disk"]:
        assert f"[rank 0] {line}\n" in text


@pytest.mark.timeout(30)
def test_lines_reach_a_buffered_file_while_the_run_goes_on(tmp_path):
    """A pipe or a CI log is block-buffered: each poll's lines are flushed, not held."""
    target = tmp_path / "out.txt"
    with open(target, "w", buffering=1 << 20) as out:
        display = RunDisplay(tmp_path, [0], console=Console(file=out, force_terminal=False))
        with display:
            append(tmp_path / "logs" / "rank-0.log", "one line\n")
            wait_until(lambda: "[rank 0] one line" in target.read_text())


@pytest.mark.timeout(30)
def test_lines_a_blocked_console_could_not_show_are_counted(tmp_path, monkeypatch, capfd):
    writing = threading.Event()

    class Blocked(io.StringIO):
        def write(self, text):
            writing.set()
            time.sleep(3600)

    monkeypatch.setattr(display_console, "DRAIN_TIMEOUT_S", 0.5)
    display = RunDisplay(tmp_path, [0], console=Console(file=Blocked(), force_terminal=False))
    display.start()
    append(tmp_path / "logs" / "rank-0.log", "first\n" + "more\n" * 2999 + "partial")
    assert writing.wait(10)  # the display took the first lines, and blocks writing them
    started = time.monotonic()
    display.stop()
    assert time.monotonic() - started < 2
    err = capfd.readouterr().err
    assert "3,001 lines were not shown (3,001 of rank 0)" in err and str(tmp_path / "logs") in err


REDRAWN_THEN_WARNED = "step 5\r[W socket.cpp:663] [c10d] failed to connect"
COLOURED = "\x1b[31mERROR\x1b[0m: boom"


@pytest.mark.parametrize(
    "line",
    [*ALERTS, "Traceback (most recent call last):", "SIGSEGV", REDRAWN_THEN_WARNED, COLOURED],
)
def test_the_chunk_prefilter_never_misses_an_alert(line):
    chunk = "ordinary\n" * 100 + line + "\n" + "ordinary\n" * 100
    # What the display's detector sees of the line: what a terminal shows of it.
    assert AlertDetector().is_alert(0, line.rsplit("\r", 1)[-1])
    assert may_hold_alerts(chunk)
    assert not may_hold_alerts("ordinary line 42 of the flood\n" * 1000)

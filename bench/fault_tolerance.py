"""The same kill, two ways: `fault_tolerance` (torchft: the other group steps on, the lost one
heals from memory) against today's whole-job restart from the last checkpoint
(`launch.max_restarts`), on the GPT recipe of bench/gpt_bench.yaml, 2 CPU processes.

    python bench/fault_tolerance.py [--train ".venv/bin/train"] [--steps 120] [--kill-at 50]

Four runs: each way once with the kill (process 1 SIGKILLs itself in micro-step KILL_AT) and
once without (the peer). Every loss call is stamped (time, process); from the stamps:
- seconds from the kill to the next step any process starts;
- time lost in all: the run's wall time against the same run without the kill;
- steps redone: loss calls beyond the run's steps, on the process that survived (torchft) or
  the one that restarted first (whole-job restart).
Writes bench/results/fault_tolerance.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from launcher.rundir import fault_events
from launcher.rundir.layout import RunLayout

REPO = Path(__file__).resolve().parent.parent

RECIPE = """
import os, signal, sys, time
sys.path.insert(0, {recipes!r})
from gpt import build_dataset, build_model  # noqa: F401
import gpt
sys.path.pop(0)

calls = 0
STAMPS = os.environ.get("STAMPS", os.devnull)
ME = os.environ.get("REPLICA_GROUP_ID", os.environ.get("RANK", "-"))


def loss(model, batch):
    global calls
    calls += 1
    with open(STAMPS, "a") as f:
        f.write(f"{{time.time()}} {{ME}} {{os.environ.get('TORCHELASTIC_RESTART_COUNT')}}\\n")
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    if first and ME == "1" and calls == int(os.environ.get("KILL_AT", "0")):
        with open(STAMPS + ".kill", "w") as f:
            f.write(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    return gpt.loss(model, batch)
"""


def _run(train: list[str], folder: Path, ft: bool, kill_at: int, steps: int) -> dict:
    spec = yaml.safe_load((REPO / "bench/gpt_bench.yaml").read_text())
    recipe = folder / "recipe.py"
    recipe.write_text(RECIPE.format(recipes=str(REPO / "recipes")))
    spec["recipe"]["source"] = str(recipe)
    spec["run"]["output_dir"] = str(folder / "runs")
    spec["launch"]["max_restarts"] = 1
    spec["train"] = {"max_steps": steps, "log_every": 10}
    spec["checkpoint"] = {"every_n_steps": 20}
    if ft:
        spec["fault_tolerance"] = {"enabled": True, "replica_groups": 2}
    config = folder / "run.yaml"
    config.write_text(yaml.safe_dump(spec))
    stamps = folder / "stamps"
    env = {**os.environ, "STAMPS": str(stamps), "KILL_AT": str(kill_at)}
    started = time.time()
    done = subprocess.run(
        [*train, "--config", str(config)], env=env, capture_output=True, text=True
    )
    wall = time.time() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    calls = [line.split() for line in stamps.read_text().splitlines()]
    (summary,) = (folder / "runs").glob("*/*/summary.json")
    median = json.loads(summary.read_text())["median_step_s"]
    record = {"wall_s": round(wall, 2), "median_step_ms": round(1000 * median, 1)}
    kill = folder / "stamps.kill"
    if kill.exists():
        at = float(kill.read_text())
        # The next step that counts: the survivor's first step without the lost group (its
        # quorum, in the run's fault-tolerance events), or the restarted job's first.
        if ft:
            events = fault_events.read(RunLayout(summary.parent).fault_events)
            short = [e for e in events if e["event"] == "quorum"]
            after = [e["time"] for e in short if e["groups"] < e["of"] and e["time"] > at]
            # None without the lost group: it was back before the survivor's next quorum.
            after = after or [e["time"] for e in short if e["time"] > at]
        else:
            after = [float(t) for t, _, attempt in calls if float(t) > at and attempt != "0"]
        record["kill_to_next_step_s"] = round(min(after) - at, 2)
        survivor = "0"  # torchft: group 0 steps on; whole job: rank 0 restarts with rank 1
        record["steps_redone"] = sum(1 for _, who, _ in calls if who == survivor) - steps
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", default=str(REPO / ".venv/bin/train"))
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--kill-at", type=int, default=50)
    args = parser.parse_args()
    train = shlex.split(args.train)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, ft in (("whole_job_restart", False), ("torchft", True)):
            for kill in (0, args.kill_at):
                folder = Path(tmp) / f"{name}-{kill}"
                folder.mkdir()
                results[f"{name}{'_killed' if kill else ''}"] = _run(
                    train, folder, ft, kill, args.steps
                )
    for name in ("whole_job_restart", "torchft"):
        killed = results[f"{name}_killed"]
        killed["time_lost_s"] = round(killed["wall_s"] - results[name]["wall_s"], 2)
    out = REPO / "bench/results/fault_tolerance.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""Learning-rate schedules: their shapes, and a resume that goes on exactly where the
schedule of the run's length is, also when the resume makes the run longer."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from launcher.config.optim import OptimSection
from launcher.worker.optim import (
    apply_after_load,
    build_optimizer,
    build_scheduler,
    group_settings,
    lr_factor,
    rates_used,
)

SCHEDULES = ["constant", "cosine", "linear", "wsd"]


def _optimizer(optim: OptimSection) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))]
    return build_optimizer(optim, [{"params": params[:1]}, {"params": params[1:], "lr": 0.5}])


def _lrs(optimizer: torch.optim.Optimizer, scheduler, steps: int) -> list[list[float]]:
    seen = []
    for _ in range(steps):
        seen.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return seen


def test_each_schedule_has_its_shape() -> None:
    def factors(schedule: str, **keys: object) -> list[float]:
        optim = OptimSection(schedule=schedule, warmup_steps=2, min_lr_ratio=0.1, **keys)  # type: ignore[arg-type]
        return [round(lr_factor(optim, step, 12), 4) for step in range(12)]

    assert factors("constant") == [0.5] + [1.0] * 11
    linear = factors("linear")
    assert linear[:3] == [0.5, 1.0, 1.0] and linear[-1] == round(0.1 + 0.9 * 0.1, 4)
    assert all(a > b for a, b in itertools.pairwise(linear[2:]))
    cosine = factors("cosine")
    assert cosine[7] == round(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), 4)
    # wsd: warmup, then lr until the last 20% (2 of 12 steps, rounded), then down to 10%.
    assert factors("wsd") == [0.5] + [1.0] * 10 + [0.55]
    assert factors("wsd", decay_steps=4) == [0.5] + [1.0] * 8 + [0.775, 0.55, 0.325]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_resume_goes_on_exactly_also_with_a_longer_run(schedule: str) -> None:
    """Stopped at step 4 of 8, resumed as a run of 12: every group's rate from step 4 on is
    that of a run of 12 from the start, bit for bit."""
    optim = OptimSection(schedule=schedule, lr=0.1, warmup_steps=2, min_lr_ratio=0.05)
    first = _optimizer(optim)
    scheduler = build_scheduler(optim, first, total_steps=8)
    _lrs(first, scheduler, 4)
    saved_optimizer, saved_scheduler = first.state_dict(), scheduler.state_dict()

    resumed = _optimizer(optim)
    wanted = group_settings(resumed)
    again = build_scheduler(optim, resumed, total_steps=12)
    resumed.load_state_dict(saved_optimizer)
    again.load_state_dict(saved_scheduler)
    apply_after_load(wanted, resumed, again)

    longer = _optimizer(optim)
    reference = _lrs(longer, build_scheduler(optim, longer, total_steps=12), 12)
    assert _lrs(resumed, again, 8) == reference[4:]
    assert reference[4][1] == pytest.approx(
        5 * reference[4][0]
    )  # each group's own lr, scheduled alike


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_logged_rates_are_those_the_update_used(schedule: str) -> None:
    """After update N the logged `lr` is the one update N used (warmup's first is half the
    peak with 2 warmup steps), and each group's where their rates differ."""
    optim = OptimSection(lr=0.1, schedule=schedule, warmup_steps=2)  # type: ignore[arg-type]
    optimizer = _optimizer(optim)
    scheduler = build_scheduler(optim, optimizer, total_steps=6)
    for step in range(1, 7):
        used = [g["lr"] for g in optimizer.param_groups]
        optimizer.step()
        scheduler.step()
        rates = rates_used(optim, scheduler, ["group1", "head"])
        assert rates == {"lr": used[0], "lr/group1": used[0], "lr/head": used[1]}, step
        if step == 1:
            assert rates["lr"] == 0.1 * 0.5
    alike = build_optimizer(optim, [{"params": [torch.nn.Parameter(torch.ones(2))]}])
    one = build_scheduler(optim, alike, total_steps=6)
    alike.step()
    one.step()
    assert rates_used(optim, one, ["group1"]) == {"lr": 0.05}  # one rate: no groups' keys
    # One group whose own rate is not optim.lr: `lr` alone would be a rate nothing took.
    own = build_optimizer(optim, [{"params": [torch.nn.Parameter(torch.ones(2))], "lr": 0.01}])
    scheduled = build_scheduler(optim, own, total_steps=6)
    own.step()
    scheduled.step()
    assert rates_used(optim, scheduled, ["all"]) == {"lr": 0.05, "lr/all": 0.01 * 0.5}

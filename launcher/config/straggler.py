"""The `launch.straggler` section: naming a rank that is merely slow, which sets the pace of
every rank it syncs with (`launcher.config.spec` re-exports it). The worker's side is
`launcher.worker.stragglers`; docs/resume-and-faults.md says what is measured and what to do."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from launcher.config.section import PositiveInt, Section


def _off(value: Any) -> Any:
    """YAML reads a bare `off` as false: it means `off` here."""
    return "off" if value is False else value


class StragglerSection(Section):
    factor: float = Field(
        1.3,
        gt=1.0,
        description="A rank is a straggler when its compute or its data time per step is at "
        "least this many times the median of the other ranks' (and the gap is at least 5% of "
        "a step), `window` logged windows in a row. The time a rank waits for the others in "
        "collectives never counts: it grows on every rank but the straggler.",
    )
    window: PositiveInt = Field(
        3,
        description="Logged windows (`train.log_every` steps each) in a row a rank must be "
        "that slow before it is named, and as fast again before it counts as recovered.",
    )
    action: Annotated[Literal["warn", "stop", "restart", "off"], BeforeValidator(_off)] = Field(
        "warn",
        description="`warn`: one line when a straggler is found and one when it recovers; "
        "the run goes on at its pace. `stop`: save, then stop with a line naming the rank "
        "and its host, so that its node can be replaced and `--resume` continue. `restart` "
        "(under `fault_tolerance`): the straggler's replica group restarts and heals from a "
        "live group while the others train on; a group still slow after "
        "`launch.max_restarts` restarts is left out. `off`: no timing at all.",
    )

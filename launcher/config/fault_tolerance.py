"""The `fault_tolerance` section: replica groups on torchft (`launcher.config.spec` re-exports
it), which agree every step or, with `sync`, every few steps (LocalSGD, DiLoCo). It picks the
run's replica engine (`launcher.replicas.registry`): the launcher's side is
`launcher.replicas.torchft_coordinator`, the workers' `launcher.replicas.torchft_engine` and
`launcher.replicas.semi_sync`; docs/fault-tolerance.md says when to use which."""

from __future__ import annotations

import importlib.util
import re
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from launcher.config.optim import (
    bad_values,
    find_optimizer,
    rejected_settings,
    skip_torch_checks,
    unknown_options,
)
from launcher.config.section import Section
from launcher.errors import UsageError

# Across machines: the replica groups' shared secret, set alike on every node (else one is
# derived from the job's name: docs/fault-tolerance.md).
FT_SECRET_VARIABLE = "LAUNCHER_FT_SECRET"

_ADDRESS = re.compile(r"^(https?://)?[^\s:/]+:\d{1,5}$")


SyncMethod = Literal["every_step", "local_sgd", "diloco"]

# DiLoCo's outer optimizer as the paper has it (Douillard et al., 2023): Nesterov SGD.
OUTER_OPTIM_DEFAULT: dict[str, Any] = {"name": "SGD", "lr": 0.7, "momentum": 0.9, "nesterov": True}


class SyncSection(Section):
    method: SyncMethod = Field(
        "every_step",
        description="How often the replica groups agree: `every_step` (their gradients "
        "averaged before every optimizer step: the groups move as one), `local_sgd` (each "
        "group takes `every` steps on its own, then the groups' weights are averaged) or "
        "`diloco` (each group takes `every` steps on its own, then the change each made since "
        "the last sync is averaged and applied by `outer_optim`). The last two send about "
        "`every` times fewer bytes between groups: for groups joined by slow links.",
    )
    every: int = Field(
        50,
        ge=1,
        description="`local_sgd` and `diloco`: the steps each group takes between syncs "
        "(DiLoCo's H). A checkpoint saved at a sync holds one model for every group: make "
        "`checkpoint.every_n_steps` a multiple of it.",
    )
    outer_optim: dict[str, Any] = Field(
        default_factory=lambda: dict(OUTER_OPTIM_DEFAULT),
        description="`diloco`: the optimizer applying the groups' averaged change at each "
        "sync: `name` (a `torch.optim` class, as `optim.name`), `lr`, and its other arguments, "
        "e.g. `{name: SGD, lr: 0.7, momentum: 0.9, nesterov: true}` (the default, the "
        "paper's). `{name: SGD, lr: 1.0}` is `local_sgd`.",
    )

    fragments: int = Field(
        1,
        ge=1,
        description="`diloco`: sync the model in this many fragments of whole blocks (a "
        "transformer's layers), one fragment in turn every `every / fragments` steps "
        "(streaming DiLoCo), so that each sync sends a fragment's bytes instead of the whole "
        "model's. It must divide `every` and the model's blocks (`train validate` says).",
    )

    @model_validator(mode="after")
    def _fragments_fit(self) -> SyncSection:
        if self.fragments == 1:
            return self
        if self.method != "diloco":
            raise ValueError(
                f"fragments: {self.fragments} fragments are streaming DiLoCo's; set method: "
                f"diloco, or fragments: 1"
            )
        if self.every % self.fragments:
            raise ValueError(
                f"fragments: {self.fragments} does not divide every ({self.every}): each "
                "fragment syncs once per round, every / fragments steps apart"
            )
        return self

    @field_validator("outer_optim")
    @classmethod
    def _outer_optimizer(cls, given: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        options = {**given}
        name, lr = options.pop("name", "SGD"), options.pop("lr", OUTER_OPTIM_DEFAULT["lr"])
        if not isinstance(name, str):
            raise ValueError(f"outer_optim.name: expected an optimizer's name, got {name!r}")
        if not isinstance(lr, int | float) or isinstance(lr, bool):
            raise ValueError(f"outer_optim.lr: expected a number, got {lr!r}")
        problem = bad_values({"lr": lr, **options})
        # The default is known to build, and checking it would import torch into every
        # spec's validation, the torch-free one too (a section's default is made without
        # the validation's context).
        checked = given != OUTER_OPTIM_DEFAULT and not skip_torch_checks(info)
        if problem is None and checked:
            found = find_optimizer(name)
            problem = (
                found
                if isinstance(found, str)
                else unknown_options(name, options) or rejected_settings(name, lr, options)
            )
        if problem:
            raise ValueError(f"outer_optim: {problem}")
        return {"name": name, "lr": lr, **options}

    @property
    def semi_synchronous(self) -> bool:
        """Whether the groups train apart between syncs."""
        return self.method != "every_step"


class FaultToleranceSection(Section):
    enabled: bool = Field(
        False,
        description="Train on through the loss of a replica group: the other groups keep "
        "stepping, and the lost group restarts (up to `launch.max_restarts` times) and copies "
        "the weights from a live group's memory instead of the whole job reloading a "
        "checkpoint. Needs torchft (extra `launcher[ft]`) and `launch.strategy` ddp or fsdp.",
    )
    replica_groups: int = Field(
        2,
        ge=1,
        description="Replica groups on each machine: its processes (`launch.devices`) are "
        "split evenly between them, and each group trains a whole replica (ddp, or fsdp "
        "sharded inside the group). With `--nnodes N`, the run has N times as many, node K's "
        "after those of the nodes before it; 1 makes each node one group.",
    )
    lighthouse: str = Field(
        "auto",
        description="torchft's Lighthouse, which forms each step's quorum of groups: `auto` "
        "(the launcher starts one, on loopback, for a run of one machine; with `--nnodes`, node "
        "0 starts one at its `--rdzv-endpoint` host, on port `lighthouse_port`), or the "
        "`HOST:PORT` of one already running (`torchft_lighthouse`).",
    )
    lighthouse_port: int = Field(
        29510,
        ge=1,
        le=65535,
        description="With `--nnodes` and `lighthouse: auto`: the port node 0's Lighthouse "
        "listens on.",
    )
    heartbeat_timeout_ms: int = Field(
        1000,
        ge=100,
        le=600_000,  # 10 minutes: a loss unseen for longer stalls every group as long
        description="How long a group may go unheard before the Lighthouse drops it from the "
        "quorum: the survivors' next step comes about this long after a loss.",
    )
    min_replicas: int = Field(
        1,
        ge=1,
        description="The fewest groups a step may train with; below it, the groups wait for "
        "others to join.",
    )
    timeout_s: float = Field(
        60,
        gt=0,
        le=3600,
        description="How long a collective between groups, or a quorum, may take before it "
        "counts as failed: a group that hangs without dying is dropped after this.",
    )

    sync: SyncSection = Field(
        default_factory=SyncSection,
        description="How often the groups agree: every step, or every few steps "
        '(docs/fault-tolerance.md, "Groups joined by slow links").',
    )

    @model_validator(mode="after")
    def _sync_needs_groups(self) -> FaultToleranceSection:
        if self.sync.semi_synchronous and not self.enabled:
            raise ValueError(
                f"sync.method: {self.sync.method} syncs replica groups, and there are none; "
                "set fault_tolerance.enabled: true (or remove fault_tolerance.sync)"
            )
        return self

    @field_validator("lighthouse")
    @classmethod
    def _address(cls, value: str) -> str:
        if value != "auto" and not _ADDRESS.match(value):
            raise ValueError(f"expected auto or HOST:PORT, got {value!r}")
        return value

    def lighthouse_url(self, host: str | None = None) -> str | None:
        """The Lighthouse's address as torchft takes it; None where the launcher starts one
        on loopback (`host` None: one machine)."""
        if self.lighthouse != "auto":
            given = self.lighthouse
            return given if given.startswith("http") else f"http://{given}"
        return f"http://{host}:{self.lighthouse_port}" if host else None


def restart_warnings(enabled: bool, max_restarts: int) -> list[str]:
    """What `train validate` and `train` warn of: without restarts, a lost group never comes
    back, and the run only shrinks."""
    if not enabled or max_restarts > 0:
        return []
    return [
        "fault_tolerance with launch.max_restarts 0: a lost replica group is never restarted, "
        "so the run only shrinks; set launch.max_restarts (e.g. 3) for lost groups to come "
        "back and heal"
    ]


def require_torchft() -> None:
    """torchft, or one line naming the extra (before anything starts: `train` and
    `train validate`)."""
    if importlib.util.find_spec("torchft") is None:
        raise UsageError(
            "fault_tolerance: needs torchft, which is not installed",
            hint="pip install 'launcher[ft]', or set fault_tolerance.enabled: false.",
        )

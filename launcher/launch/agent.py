"""torch.distributed's elastic agent, configured from a plan: the one place that says how the
workers are started (torchrun's `config_from_args`, for our plan instead of its flags). Who
starts them, a new interpreter each or the workers' fork server, is `fork_server.py`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import sys
import threading
import uuid
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import LogsDest
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from launcher.config.loader import spec_to_yaml
from launcher.launch import rendezvous
from launcher.launch.plan import LaunchPlan
from launcher.rundir.layout import RunLayout

WORKER_MODULE = "launcher.worker.main"
_logger = logging.getLogger(__name__)


def agent_config(
    plan: LaunchPlan,
    on_round: Callable[[rendezvous.Round], None],
    group: int | None = None,  # a replica group's own agent (`fault_tolerance`): its index here
) -> tuple[LaunchConfig, list[str]]:
    """The elastic agent's configuration, and the arguments of the interpreter it starts:
    the worker module and the one file that tells a worker everything (`--plan`).
    `on_round` is called with each rendezvous round, before that round's workers start.
    A replica group's agent runs a group of this machine alone: its rendezvous is its own,
    whatever the run's nodes."""
    nodes = plan.nodes
    folder = plan.node_dir if group is None else RunLayout.replica_group(plan.node_dir, group)
    one_node = group is not None or not nodes.multi
    listen = plan.listen if group is not None else rendezvous.LOOPBACK
    node = rendezvous.NodeConfig(
        nproc=plan.nproc if group is None else plan.group_size,
        spec_digest=hashlib.sha256(spec_to_yaml(plan.spec).encode()).hexdigest()[:12],
        node_rank=None if one_node else nodes.node_rank,
        loopback=one_node,
        listen=listen,
        on_round=on_round,
    )
    run_id = f"{plan.spec.run.name}-{uuid.uuid4().hex[:8]}"
    config = LaunchConfig(
        min_nodes=1 if one_node else nodes.min,
        max_nodes=1 if one_node else nodes.max,
        nproc_per_node=node.nproc,
        # The same on every node; a single node's own, so that two runs never share one.
        run_id=run_id if one_node else str(nodes.job_id),
        rdzv_backend=rendezvous.register(),
        # One node: c10d's rendezvous on stores that listen on loopback only, each on a free
        # port of its own (so two runs never race for one).
        rdzv_endpoint=f"{listen}:0" if one_node else nodes.endpoint,
        rdzv_configs=node.rdzv_configs(),
        # The address the other nodes reach this one at: the workers' MASTER_ADDR on node 0.
        local_addr=_local_addr(plan, group),
        max_restarts=plan.spec.launch.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=AgentLogs(log_dir=str(RunLayout.agent_logs(folder))),
    )
    argv = ["-u", "-m", WORKER_MODULE, "--plan", str(RunLayout.worker_plan(folder))]
    return config, argv


def _local_addr(plan: LaunchPlan, group: int | None) -> str | None:
    """MASTER_ADDR: loopback on one machine; a replica group's, where the other machines'
    groups reach its store (`plan.group_host`); else torch's choice (the host name)."""
    if group is not None:
        return plan.group_host
    if not plan.nodes.multi or plan.nodes.is_local:
        return rendezvous.LOOPBACK
    return None


class AgentLogs(DefaultLogsSpecs):
    """The agent's own logs, torch's way, except that the agent never reads a worker's
    error file.

    torch's agent parses a failed worker's error file (TORCHELASTIC_ERROR_FILE), and an empty
    or torn one (a full disk, a rank killed while writing it) makes the agent itself fail with
    a JSONDecodeError instead of reporting the worker's failure. The launcher needs none of
    it: its report comes from the rank's log, exit code and failure record. So workers still
    write theirs, where torch puts it, and the agent is handed os.devnull instead, as torch
    does itself when it keeps no logs."""

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = super().reify(envs)
        return dataclasses.replace(dest, error_files=dict.fromkeys(dest.error_files, os.devnull))


class AgentThread(threading.Thread):
    """The elastic agent, on a thread of its own: the main thread keeps the signals (a first
    Ctrl-C stops the run gracefully, a second at once) and the watchdog."""

    def __init__(
        self,
        config: LaunchConfig,
        argv: list[str],
        name: str = "elastic-agent",
        environment: dict[str, str] | None = None,
    ) -> None:
        """`environment`: variables of this agent's workers alone, set before they start (the
        agents share the launcher's own environment)."""
        super().__init__(name=name, daemon=True)
        self.config, self.argv = config, argv
        self.entrypoint = sys.executable
        if environment:  # `env` sets them, then becomes the interpreter (the same process)
            self.entrypoint = shutil.which("env") or "/usr/bin/env"
            self.argv = [*(f"{k}={v}" for k, v in environment.items()), sys.executable, *argv]
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            elastic_launch(self.config, self.entrypoint)(*self.argv)
        except BaseException as exc:
            self.error = exc


def quiet_elastic(debug: bool) -> None:
    # The agent's INFO/WARNING chatter repeats what the display shows; --debug brings it back.
    level = logging.INFO if debug else logging.CRITICAL
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(level)

"""A fault-tolerant run on one machine (`fault_tolerance`): torchft's Lighthouse, and one
elastic agent per replica group, each with its own rendezvous, restarts and processes.

A group whose process fails is restarted by its own agent, alone: the other groups step on
without it after the Lighthouse's heartbeat timeout, and the restarted group copies a live
group's state (`launcher.parallel.fault_tolerant`). A group that fails more than
`launch.max_restarts` times is left out; the run ends well while one group finishes. The
Lighthouse lost, no new quorum can form: the run stops, its checkpoints intact.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from rich.console import Console
from rich.text import Text

from launcher.config.yaml_file import clip
from launcher.launch import lighthouse, rendezvous
from launcher.launch.agent import AgentThread, agent_config
from launcher.launch.display import RunDisplay
from launcher.launch.interfaces import host_port, is_loopback
from launcher.launch.plan import LaunchPlan
from launcher.launch.ranks import format_ranks
from launcher.launch.supervise import AgentWatch, NodeView, Outcome, supervise
from launcher.launch.watchdog import Stall, Watchdog
from launcher.rundir import fault_events
from launcher.rundir.layout import RunLayout
from launcher.rundir.worker_plan import ReplicaGroup
from launcher.safe_text import clean


def supervise_groups(plan: LaunchPlan, console: Console, spare: int) -> Outcome:
    """Starts the Lighthouse (`lighthouse: auto`, on node 0) and every group's agent on this
    machine, and supervises them until every group has ended."""
    if plan.writes_shared_files:  # an earlier attempt's events are not this one's
        plan.layout.fault_events.write_text("")
    with _lighthouse(plan) as (address, ours):
        view = GroupsView(plan, console)
        agents = [_group_agent(plan, group, address, view) for group in range(plan.replica_groups)]
        first, size = plan.first_group, plan.group_size
        groups = f"{first}-{first + plan.replica_groups - 1}" if plan.replica_groups > 1 else first
        console.print(
            f"fault tolerance: replica groups {groups} of {plan.all_groups} here, "
            f"{size} process{'es' if size > 1 else ''} each, Lighthouse at {address}",
            highlight=False,
            soft_wrap=True,
        )
        return supervise(
            plan, agents, view, console, spare, GroupsWatch(plan, console, ours, address)
        )


@contextlib.contextmanager
def _lighthouse(plan: LaunchPlan) -> Iterator[tuple[str, lighthouse.Lighthouse | None]]:
    """The Lighthouse's address, and its process where this launcher started it: a given
    one's (`fault_tolerance.lighthouse: HOST:PORT`), or ours (`auto`): on loopback for a run
    of one machine, else on node 0 at `--rdzv-endpoint`'s host, port `lighthouse_port`."""
    options, nodes = plan.spec.fault_tolerance, plan.nodes
    given = options.lighthouse_url(nodes.host if nodes.multi else None)
    if given is not None and (options.lighthouse != "auto" or nodes.node_rank != 0):
        yield given, None
        return
    port = options.lighthouse_port if nodes.multi else 0
    bind = host_port(plan.listen, port)
    with lighthouse.started(options, bind, plan.layout.logs / "lighthouse.log") as ours:
        yield (given or ours.address), ours


def _group_agent(plan: LaunchPlan, index: int, address: str, view: GroupsView) -> AgentThread:
    """Group `index`'s agent, its worker plan written."""
    group = ReplicaGroup(
        index=plan.first_group + index,
        count=plan.all_groups,
        lighthouse=address,
        host=plan.group_host,
        first_device=index * plan.group_size,
        events=str(plan.layout.fault_events.absolute()),
        listen=plan.listen,
        token=plan.replica_token,
    )
    folder = RunLayout.replica_group(plan.node_dir, index)
    folder.mkdir(parents=True, exist_ok=True)
    plan.worker_plan(group).write(RunLayout.worker_plan(folder))
    config, argv = agent_config(plan, functools.partial(view.follow_group, index), group=index)
    # For recipes and tools (`/proc/PID/environ` too): torchft's name for the group's index.
    environment = {"REPLICA_GROUP_ID": str(group.index)}
    return AgentThread(config, argv, name=f"elastic-agent-group-{index}", environment=environment)


class GroupsWatch(AgentWatch):
    def __init__(
        self,
        plan: LaunchPlan,
        console: Console,
        light: lighthouse.Lighthouse | None,
        address: str,
    ) -> None:
        self.plan, self.console, self.light, self.lighthouse = plan, console, light, address
        self.agents_ended: list[str] = []
        self.new_events = fault_events.NewEvents(plan.layout.fault_events)

    def ended(self, agent: AgentThread) -> None:
        group = self.plan.first_group + int(agent.name.rsplit("-", 1)[1])
        if agent.error is None:
            return  # finished its steps; the others finish theirs
        fault_events.record(self.plan.layout.fault_events, "gave_up", group=group)
        self.console.print(
            Text(
                f"replica group {group} failed {self.plan.spec.launch.max_restarts + 1} times "
                "(launch.max_restarts): the other groups go on without it",
                style="bold yellow",
            ),
            soft_wrap=True,
        )

    def fault(self) -> str | None:
        for event in self.new_events():
            if event.get("event") == "stranger":
                return self._stranger(str(event.get("replica")))
        if self.light is None or self.light.alive():
            return None
        return (
            f"the fault-tolerance Lighthouse ({self.light.describe_end()}) is gone: no "
            "group can step without it; stopping the run"
        )

    def _stranger(self, replica: str) -> str:
        where = "on this machine" if is_loopback(self.plan.listen) else "on its network"
        return (
            f"a replica that is not one of this run's groups ({clip(clean(replica), 80)!r}) "
            f"joined its quorum at the Lighthouse {self.lighthouse}: stopping the run rather "
            f"than trust it. Something {where} can reach the Lighthouse: see "
            "docs/fault-tolerance.md, 'What a run exposes'"
        )

    def outcome_error(self, agents: list[AgentThread]) -> BaseException | None:
        # The run did its work where any group finished it.
        if any(agent.error is None for agent in agents):
            return None
        return agents[0].error


def report_fault(fault: str, plan: LaunchPlan, console: Console) -> int:
    """The run stopped by a lost Lighthouse: where it can go on from."""
    latest = plan.store.latest()  # listed again: the run saved since the plan's listing
    said = (
        f"checkpoints are intact (newest: {latest.name}). Continue with: --resume {plan.run_dir}"
        if latest
        else "no checkpoint was saved yet"
    )
    console.print(said, highlight=False, soft_wrap=True)
    return 1


class GroupsView(NodeView):
    """One display of every group's ranks; a hang watchdog per group, started again with
    each of its rounds (a restart)."""

    def __init__(self, plan: LaunchPlan, console: Console) -> None:
        super().__init__(plan, console)
        self._watchdogs: dict[int, Watchdog] = {}
        self._rounds: dict[int, int] = {}
        first = plan.first_group * plan.group_size
        self.ranks = range(first, first + plan.nproc)

    def follow_group(self, local: int, round: rendezvous.Round) -> None:
        plan, size = self.plan, self.plan.group_size
        group = plan.first_group + local
        ranks = range(group * size, (group + 1) * size)
        for rank in ranks:  # left by the group's earlier attempt: not a stall
            plan.layout.beat(rank).unlink(missing_ok=True)
        with self._lock:
            restarted = group in self._rounds
            self._rounds[group] = self._rounds.get(group, 0) + 1
            self._watchdogs[group] = Watchdog(plan.run_dir, ranks, plan.spec.launch.stall_timeout)
            if self._display is None:
                self._display = RunDisplay(
                    plan.run_dir, ranks=self.ranks, show=plan.show_ranks, console=self.console,
                    title=plan.spec.run.name,
                )  # fmt: skip
                self._display.start()
        if restarted:
            fault_events.record(plan.layout.fault_events, "lost", group=group)
            self.console.print(
                Text(
                    f"replica group {group} (ranks {format_ranks(ranks)}) lost: restarting it; "
                    "it copies a live group's state, and the others step on",
                    style="yellow",
                ),
                soft_wrap=True,
            )

    def stalls(self, stop_asked_s: float | None = None) -> list[Stall]:
        with self._lock:
            watchdogs = list(self._watchdogs.values())
        found: list[Stall] = []
        for watchdog in watchdogs:
            if stop_asked_s is not None:
                found += watchdog.check_after_stop(stop_asked_s)
            found += watchdog.check()
        return found

"""The launcher's side of a fault-tolerant run on torchft (`fault_tolerance`): torchft's
Lighthouse, and one elastic agent per replica group of this machine, each with its own
rendezvous, restarts and processes. Imported by name (`launcher.replicas.registry`): `check`
before launch, `supervise` to run the groups.

A group whose process fails is restarted by its own agent, alone: the other groups step on
without it after the Lighthouse's heartbeat timeout, and the restarted group copies a live
group's state (`launcher.replicas.torchft_engine`). A group that fails more than
`launch.max_restarts` times is left out; the run ends well while one group finishes. The
Lighthouse lost, no new quorum can form: the run stops, its checkpoints intact.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from rich.console import Console
from rich.text import Text

from launcher.clusters.nodes import Nodes
from launcher.config.fault_tolerance import require_torchft
from launcher.config.spec import RunSpec
from launcher.config.yaml_file import clip
from launcher.errors import UsageError
from launcher.launch import rendezvous
from launcher.launch.agent import AgentThread, agent_config
from launcher.launch.display import RunDisplay
from launcher.launch.display.lines import format_ranks
from launcher.launch.interfaces import host_port, is_loopback
from launcher.launch.plan import LaunchPlan
from launcher.launch.supervise import AgentWatch, NodeView, Outcome
from launcher.launch.supervise import supervise as supervise_agents
from launcher.launch.watchdog import Stall, Watchdog
from launcher.replicas import lighthouse
from launcher.rundir import fault_events
from launcher.rundir.layout import RunLayout
from launcher.rundir.worker_plan import ReplicaGroup
from launcher.safe_text import clean


def check(spec: RunSpec, processes: int, nodes: Nodes, listen: str) -> None:
    """Before launch: torchft there, this machine's `processes` split evenly between its
    groups, enough groups for `min_replicas`, and the Lighthouse
    (`lighthouse.check_before_launch`). UsageError naming the key where not."""
    require_torchft()
    options = spec.fault_tolerance
    groups = options.replica_groups
    if nodes.multi and (nodes.elastic or nodes.node_rank is None):
        raise UsageError(
            "fault_tolerance: on several machines every node needs a fixed --nnodes and its "
            "--node-rank: it names the node's replica groups",
            hint="docs/fault-tolerance.md, 'Several machines'.",
        )
    if groups * nodes.max < 2:
        raise UsageError(
            f"fault_tolerance.replica_groups: {groups}: a group survives only beside another; "
            "give 2 or more (or run on several nodes)",
        )
    if processes % groups:
        raise UsageError(
            f"fault_tolerance.replica_groups: {groups} groups cannot share {processes} "
            "processes evenly (launch.devices)",
            hint=f"Use a multiple of {groups} devices, or another number of groups.",
        )
    all_groups = groups * nodes.max
    if options.min_replicas > all_groups:
        raise UsageError(
            f"fault_tolerance.min_replicas: {options.min_replicas}, but the run has "
            f"{all_groups} replica groups: no step could ever train",
            hint=f"Set it to {all_groups} or fewer (1: train on while any group is left).",
        )
    lighthouse.check_before_launch(options, nodes, listen)


def supervise(plan: LaunchPlan, console: Console, spare: int) -> Outcome:
    """Starts the Lighthouse (`lighthouse: auto`, on node 0) and every group's agent on this
    machine, and supervises them until every group has ended."""
    with _lighthouse(plan) as (address, ours):
        groups = [plan.replica_group(local, address) for local in range(plan.replica_groups)]
        _start_events_over(plan, groups)
        view = GroupsView(plan, console, groups)
        agents = [_group_agent(plan, group, view) for group in groups]
        first, last, size = groups[0].index, groups[-1].index, groups[0].size
        here = f"{first}-{last}" if last > first else first
        console.print(
            f"fault tolerance: replica groups {here} of {groups[0].count} here, "
            f"{size} process{'es' if size > 1 else ''} each, Lighthouse at {address}",
            highlight=False,
            soft_wrap=True,
        )
        watch = GroupsWatch(plan, console, groups, ours, address)
        return supervise_agents(plan, agents, view, console, spare, watch)


def _start_events_over(plan: LaunchPlan, groups: list[ReplicaGroup]) -> None:
    """An earlier attempt's events are not this one's: this launcher's and its groups'
    processes' files go; node 0 also removes those of writers the run no longer has."""
    events, node = plan.layout.fault_events, plan.nodes.node_rank or 0
    own = [RunLayout.launcher_events(events, node)]
    own += [RunLayout.rank_events(events, rank) for group in groups for rank in group.ranks]
    others = None
    if plan.writes_shared_files:
        size, count = groups[0].size, groups[0].count
        others = [RunLayout.launcher_events(events, n) for n in range(plan.nodes.max)]
        others += [RunLayout.rank_events(events, rank) for rank in range(size * count)]
    fault_events.start_over(events, own, others)


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


def _group_agent(plan: LaunchPlan, group: ReplicaGroup, view: GroupsView) -> AgentThread:
    """`group`'s agent, its worker plan written."""
    local = group.local_index
    folder = RunLayout.replica_group(plan.node_dir, local)
    folder.mkdir(parents=True, exist_ok=True)
    plan.worker_plan(group).write(RunLayout.worker_plan(folder))
    config, argv = agent_config(plan, functools.partial(view.follow_group, group), group=local)
    # For recipes and tools (`/proc/PID/environ` too): torchft's name for the group's index.
    environment = {"REPLICA_GROUP_ID": str(group.index)}
    return AgentThread(config, argv, name=f"elastic-agent-group-{local}", environment=environment)


class GroupsWatch(AgentWatch):
    def __init__(
        self,
        plan: LaunchPlan,
        console: Console,
        groups: list[ReplicaGroup],
        light: lighthouse.Lighthouse | None,
        address: str,
    ) -> None:
        self.plan, self.console, self.groups = plan, console, groups
        self.light, self.lighthouse = light, address
        events = plan.layout.fault_events
        self.events = RunLayout.launcher_events(events, plan.nodes.node_rank or 0)
        self.new_events = fault_events.NewEvents(events)

    def ended(self, agent: AgentThread) -> None:
        group = self.groups[int(agent.name.rsplit("-", 1)[1])].index
        if agent.error is None:
            return  # finished its steps; the others finish theirs
        fault_events.record(self.events, "gave_up", group=group)
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


class GroupsView(NodeView):
    """One display of every group's ranks; a hang watchdog per group, started again with
    each of its rounds (a restart)."""

    def __init__(self, plan: LaunchPlan, console: Console, groups: list[ReplicaGroup]) -> None:
        super().__init__(plan, console)
        self._watchdogs: dict[int, Watchdog] = {}
        self._rounds: dict[int, int] = {}
        self.ranks = range(groups[0].ranks.start, groups[-1].ranks.stop)
        self.events = RunLayout.launcher_events(plan.layout.fault_events, plan.nodes.node_rank or 0)

    def follow_group(self, group: ReplicaGroup, round: rendezvous.Round) -> None:
        plan, ranks = self.plan, group.ranks
        for rank in ranks:  # left by the group's earlier attempt: not a stall
            plan.layout.beat(rank).unlink(missing_ok=True)
        with self._lock:
            restarted = group.index in self._rounds
            self._rounds[group.index] = self._rounds.get(group.index, 0) + 1
            self._watchdogs[group.index] = Watchdog(
                plan.run_dir, ranks, plan.spec.launch.stall_timeout
            )
            if self._display is None:
                self._display = RunDisplay(
                    plan.run_dir, ranks=self.ranks, show=plan.show_ranks, console=self.console,
                    title=plan.spec.run.name,
                )  # fmt: skip
                self._display.start()
        if restarted:
            fault_events.record(self.events, "lost", group=group.index)
            self.console.print(
                Text(
                    f"replica group {group.index} (ranks {format_ranks(ranks)}) lost: "
                    "restarting it; it copies a live group's state, and the others step on",
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

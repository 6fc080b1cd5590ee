"""What the torch_xla strategies (`xla`, `xla_spmd`, `xla_fsdp`) share.

XLA traces each step into a graph and compiles every graph it has not seen: the loop must
never read a device value mid-step (`read` goes through step closures), and a step that
compiles after warm-up is almost always a bug (a changing shape or Python value), so the
`CompileGuard` says so loudly, or stops the run with `xla.strict_compile`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.runtime as xr
from torch import nn

from launcher.config.spec import XLASection
from launcher.parallel.base import Strategy
from launcher.parallel.compile_guard import CompileGuard
from launcher.parallel.precision import MixedPrecision
from launcher.parallel.rng import RandomStreams


def xla_compilations() -> int:
    # A graph loaded from the persistent cache skips the compiler, yet is as new a graph.
    return _metric_count("CompileTime") + (met.counter_value("PersistentCacheHit") or 0)


def xla_compile_seconds() -> float:
    data = met.metric_data("CompileTime")
    return data[1] / 1e9 if data else 0.0


def _metric_count(name: str) -> int:
    data = met.metric_data(name)
    return int(data[0]) if data else 0


class XLARandomStreams(RandomStreams):
    """The process's generators and XLA's, which draws the device's random numbers."""

    def seed(self, seed: int) -> None:
        super().seed(seed)
        xm.set_rng_state(seed % 2**63)

    def state(self) -> dict[str, Any]:
        return {**super().state(), "xla": int(xm.get_rng_state())}

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        if "xla" in state:
            xm.set_rng_state(int(state["xla"]))


class XLAStrategyBase(Strategy):
    rng = XLARandomStreams()

    def __init__(
        self,
        accelerator: str,
        precision: str,
        options: XLASection,
        compile_cache: Path | None = None,
    ) -> None:
        self.accelerator = accelerator
        self.compile_cache = compile_cache
        self.precision = MixedPrecision(precision, "xla")
        self.options = options
        self.guard = CompileGuard(xla_compilations, options.warmup_steps, options.strict_compile)

    def start_runtime(self, writes_cache: bool) -> None:
        """Before any XLA computation: the persistent compile cache (where the plan enables it),
        which one process per cache writes and the others only read."""
        if self.compile_cache is not None:
            xr.initialize_cache(str(self.compile_cache), readonly=not writes_cache)
        self.device = torch_xla.device()

    def optimizer_defaults(self) -> dict[str, Any]:
        # Without it Adam's bias correction is a Python float per step; once it rounds to
        # exactly 1.0 in float32 (step 325 with beta2 0.95) XLA bakes a new constant into the
        # graph and compiles again. Capturable keeps the step count on the device.
        return {"capturable": True}

    def drop_update(self, optimizer: torch.optim.Optimizer) -> None:
        super().drop_update(optimizer)
        # A step without its update (train.on_nonfinite: skip), and the step after it, are
        # graphs of their own: expected, not a recompilation to warn about.
        self.guard.expect_until = self.guard.steps_run + 2

    def on_step_end(self, step: int) -> None:
        torch_xla.sync()  # cut the step's graph here and run it
        self.guard.after_step(step)

    @contextlib.contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        # Work queued since the step (the metrics of a log line) runs on its own here, a graph
        # the next step would otherwise have merged: expected, and small.
        torch_xla.sync()
        self.guard.absorb()
        yield
        torch_xla.sync()
        self.guard.after_phase(name, step)

    def read(self, values: torch.Tensor, receive: Callable[[list[float]], None]) -> None:
        # Runs once the graph that computes `values` has run: reading them now would run the
        # step's graph early, and once more.
        self.guard.reading()
        xm.add_step_closure(lambda v: receive(v.cpu().tolist()), args=(values,))

    def drain(self) -> None:
        torch_xla.sync()  # also runs queued step closures
        xm.wait_device_ops()

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.guard.steps_run and not optimizer.state:
            # A stateless optimizer (SGD without momentum). get_state_dict would prime it with
            # a zero-gradient step, a new XLA graph at every save; an empty entry says there
            # is nothing to prime.
            optimizer.state[optimizer.param_groups[0]["params"][0]] = {}
        model_sd, optim_sd = get_state_dict(model, optimizer)
        torch_xla.sync()  # run any priming as one graph, not one per tensor read
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )

    def summary(self) -> dict[str, Any]:
        counts = self.guard.summary("xla")
        seconds = round(xla_compile_seconds(), 2)
        return {"xla_compilations": counts["xla_compilations"], "xla_compile_s": seconds, **counts}

    def teardown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def join_checkpoint_group(world_size: int) -> None:
    """torch.distributed.checkpoint coordinates its writers over a CPU process group; XLA's
    runtime already knows every process, so the group rendezvouses through it (`xla://`)."""
    import torch.distributed as dist

    if world_size > 1 and not dist.is_initialized():
        import torch_xla.distributed.xla_backend  # noqa: F401 (registers xla://)

        dist.init_process_group("gloo", init_method="xla://")

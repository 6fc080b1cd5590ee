"""The one training loop. It asks the strategy for everything backend-specific."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from launcher.checkpoint import checkpointer as checkpoint
from launcher.checkpoint.selection import attempt_start
from launcher.checkpoint.state import ModelState
from launcher.checkpoint.store import store_at, store_described
from launcher.checkpoint.weights import load_weights
from launcher.config.spec import RunSpec
from launcher.metrics import memory
from launcher.metrics.sink_types import RunEnd
from launcher.metrics.sinks import build_sinks
from launcher.metrics.telemetry import Telemetry
from launcher.parallel.base import Strategy
from launcher.parallel.pipeline.given import PipelineInput
from launcher.parallel.rng import rank_seed
from launcher.parallel.weight_init import WeightInit
from launcher.rundir.layout import RunLayout
from launcher.worker.data import (
    batch_size,
    build_feed,
    example_batch,
    steps_per_epoch,
    total_steps,
)
from launcher.worker.ema import WeightAverage
from launcher.worker.evaluation import Evaluator
from launcher.worker.expert_load import ExpertLoad
from launcher.worker.flops import Speed
from launcher.worker.metrics_window import MetricsWindow
from launcher.worker.optim import build_optimizer, build_scheduler, group_settings, rates_used
from launcher.worker.param_groups import group_parameters
from launcher.worker.profiling import StepProfiler
from launcher.worker.recipe import Recipe
from launcher.worker.reporting import Reporter
from launcher.worker.resume import restart_note, restore
from launcher.worker.state import Progress, TrainState
from launcher.worker.stragglers import Slowness, StragglerWatch, by_rank, watch_pace


class Trainer:
    """Builds everything a run needs (`__init__`), then trains it (`fit`)."""

    def __init__(
        self,
        spec: RunSpec,
        recipe: Recipe,
        strategy: Strategy,
        run_dir: Path,
        attempt: int = 0,  # restarts of the run so far (torch.distributed.elastic's count)
        resume_from: Path | None = None,  # the launcher's decision, for the first attempt
        config_file: dict[str, Any] | None = None,  # the YAML file as read, for checkpoints
        store: dict[str, Any] | None = None,  # the plan's store (None: the run folder's)
        nodes_may_join: bool = True,  # the plan's: a first attempt may be one restarted
    ) -> None:
        self.spec, self.recipe, self.strategy, self.attempt = spec, recipe, strategy, attempt
        self.layout = RunLayout(run_dir)
        self.store = store_described(store) if store else store_at(self.layout.checkpoints)
        # First, so that the hang watchdog sees this process alive while it builds and restores.
        writes = strategy.engine.writes_records
        sinks = build_sinks(spec, run_dir) if writes else []
        self.telemetry = Telemetry(run_dir, strategy.engine.log_rank, writes, attempt, sinks)
        self.telemetry.beat(0)
        strategy.rng.seed(spec.run.seed)
        # A restarted replica group heals from a live one instead (`_reload` where none is).
        healing = bool(attempt) and strategy.engine.heals_from_peers
        self.resume_from = None if healing else self._start(resume_from, nodes_may_join)
        if attempt:
            note = restart_note(attempt, spec.launch.max_restarts, self.resume_from, healing)
            print(note, flush=True)
        self._train_dataset: Any = None  # built before the model where a pipeline needs it
        self.model = self._build_model()
        self.feed = self._train_feed()
        per_epoch = self.feed.batches_per_epoch  # None: a stream, which has no epochs
        accum = spec.train.grad_accum_steps
        self.steps_per_epoch = per_epoch and steps_per_epoch(per_epoch, accum)
        self.total_steps = total_steps(spec.train, self.steps_per_epoch)
        self._build_optimizer()
        micro_batches = accum / strategy.devices_per_process  # per step and device
        self.speed = Speed(strategy.device, spec.train.precision, spec.train.tf32, micro_batches)
        self.state = TrainState(
            strategy, self.scheduler, recipe, spec, self.feed, self.speed, config_file
        )
        self.evaluator = Evaluator(recipe, spec, strategy) if spec.eval.every_n_steps else None
        self.report = Reporter(
            spec, strategy, self.telemetry, self.total_steps, self.steps_per_epoch, self.speed
        )
        if self.expert_load is not None:
            self.report.watch(self.expert_load.warning)
        self.profiler = StepProfiler(
            spec.train.profile, self.layout, strategy.engine.log_rank, strategy.device
        )
        model_state = self._build_checkpointer(run_dir)
        strategy.engine.share_state(model_state, self.state, self._reload)
        self.pace, self.stragglers = watch_pace(
            spec.launch.straggler, strategy, self.model, self.layout, self._say
        )
        self.loss_of = self.pace.marking(self.loss_of)

    def _build_checkpointer(self, run_dir: Path) -> ModelState:
        """The checkpointer, of every state a checkpoint holds; returns the model's part."""
        strategy, spec = self.strategy, self.spec
        engine_state = strategy.engine.extra_state(self.model)  # DiLoCo's outer weights
        model_state = ModelState(strategy, self.model, self.optimizer, self.average, engine_state)
        self.checkpointer = checkpoint.Checkpointer(
            strategy,
            run_dir,
            model_state,
            self.state,
            keep_last=spec.checkpoint.keep_last,
            use_async=spec.checkpoint.async_,
            store=self.store,
        )
        return model_state

    def _build_model(self) -> torch.nn.Module:
        """The recipe's model, initialised (or loaded: `load.weights`), placed and wrapped."""
        spec, recipe, strategy = self.spec, self.recipe, self.strategy
        rss_before_build = memory.rss_bytes()
        model = strategy.build_model(
            lambda: recipe.build_model(**spec.recipe.model),
            WeightInit(recipe, spec.run.seed),
            recipe.parallelize_hook(),
            self._pipeline_input() if strategy.layout.pp > 1 else None,
        )
        self.memory: dict[str, int] = {"build_rss_delta": memory.rss_bytes() - rss_before_build}
        load_weights(model, strategy, spec.load, resuming=self.resume_from is not None)
        # A mixture of experts: its router's figures join the recipe's metrics.
        self.expert_load = ExpertLoad.attach(model)
        self.loss_of = self.expert_load.around(recipe.loss) if self.expert_load else recipe.loss
        return model

    def _start(self, decided: Path | None, nodes_may_join: bool = True) -> Path | None:
        """Collective: the checkpoint this attempt starts from (`attempt_start`), rank 0's
        answer: nodes started again, and nodes that restarted their workers, may each have
        seen another newest. The others never list the store for it."""
        ask = self.strategy.is_main
        root, attempt = self.layout.root, self.attempt
        start = attempt_start(decided, root, attempt, self.store, nodes_may_join) if ask else None
        return self.strategy.control.from_main(start)

    def _reload(self) -> bool:
        """Collective: restores the newest complete checkpoint, where there is one (a
        restarted replica group with no live group to heal from); whether it did."""
        newest = self._start(None)
        where = f"resuming from {newest}" if newest else "no checkpoint yet: starting over"
        self._say(f"no replica group is ahead of this one to copy from: {where}")
        if newest is None:
            return False
        self.resume_from = newest
        self._restore(newest)
        self.saved_at = self.progress.step  # the end saves nothing new at this step
        return True

    def _restore(self, path: Path) -> None:
        """Collective: every state from the checkpoint at `path`."""
        restore(path, self.checkpointer, self.state, self.strategy, self.spec, self.optim_settings)
        # Steps past this one that metrics.jsonl holds were lost with the attempt that wrote
        # them: readers drop them at this mark, and see each step once.
        self.telemetry.mark_resumed(self.progress.step)

    def _pipeline_input(self) -> PipelineInput:
        """What the strategy cuts the model into pipeline stages by (`parallel.pp`)."""
        spec, hooks = self.spec, self.recipe.pipeline_hooks()
        self._train_dataset = self.recipe.build_dataset("train", **spec.recipe.dataset)
        example = example_batch(
            self._train_dataset, spec.data.batch_size, self.recipe.collate_hook()
        )
        return PipelineInput(
            hooks.split, hooks.loss_from_output, example, spec.data.batch_size,
            spec.train.grad_accum_steps, self.recipe.source,
        )  # fmt: skip

    def _build_optimizer(self) -> None:
        """The parameter groups, the optimizer, its schedule and the weights' average."""
        spec, strategy = self.spec, self.strategy
        self.grouping = group_parameters(spec.optim, self.model, self.recipe)
        self.optimizer = build_optimizer(
            spec.optim, self.grouping.torch_groups(), strategy.optimizer_defaults(),
            strategy.device.type,
        )  # fmt: skip
        # Each group's settings as the spec and recipe say now: a resume restores them.
        self.optim_settings = group_settings(self.optimizer)
        self.scheduler = build_scheduler(spec.optim, self.optimizer, self.total_steps)
        ema = spec.train.ema
        self.average = WeightAverage(self.model, ema.decay) if ema is not None else None

    def _train_feed(self) -> Any:
        spec, strategy = self.spec, self.strategy
        dataset = self._train_dataset
        if dataset is None:
            dataset = self.recipe.build_dataset("train", **spec.recipe.dataset)
        return build_feed(
            dataset,
            spec.data,
            spec.train,
            strategy.dp_rank,
            strategy.dp_size,
            spec.run.seed,
            pin_memory=strategy.device.type == "cuda",
            devices_per_process=strategy.devices_per_process,
            collate=self.recipe.collate_hook(),
        )

    @property
    def progress(self) -> Progress:
        return self.state.progress

    def fit(self, memory_estimate: dict[str, int] | None = None) -> None:
        """Trains to the end. `memory_estimate`: the launcher's estimate of this layout's
        memory per device (GPU runs), kept in summary.json beside the measured peak."""
        for part, size in (memory_estimate or {}).items():
            self.memory[f"estimated_{part}"] = size
        # The weights and datasets, alike on every rank, were built from the run's seed: from
        # here each data-parallel rank draws its own numbers (dropout, a collate's mixup), the
        # processes of a tensor-parallel group the same ones; a resume restores them as saved.
        self.strategy.rng.seed(rank_seed(self.spec.run.seed, self.strategy.dp_rank))
        if self.resume_from is not None:
            self._restore(self.resume_from)
        self.telemetry.sinks_started()
        self.telemetry.start_from(self.progress.step)
        # Asked while the ranks were starting (a preemption, Ctrl-C on another node): no step.
        # Every rank leaves this collective together, whatever rank 0 alone did (its trackers'
        # start), so the header they all print next comes together and folds into one line.
        self.stop_requested = self.strategy.control.any_rank(self.layout.stop_request.exists())
        resumed = self.progress.step if self.resume_from else None
        self.report.introduce(self.grouping, self.feed.samples, resumed)
        ended = RunEnd("failed")  # unless _run returns
        try:
            self._run()
            ended = self._ending()
        finally:
            self.telemetry.close(ended)

    def _run(self) -> None:
        spec, progress = self.spec, self.progress
        self.saved_at = progress.step
        stopped = self.stop_requested
        if stopped:
            self._say(f"stop requested: stopping before step {progress.step + 1}")
        while progress.step < self.total_steps and not stopped:
            loaded = self.feed.start(progress.epoch, progress.samples_in_epoch)
            batches = self.feed.batches(self.strategy.loader(loaded))
            left = self.feed.steps_left(spec.train.grad_accum_steps)
            moved = False  # the data position changed under the feed: start it again there
            for _ in range(min(left, self.total_steps - progress.step)):
                started = time.perf_counter()
                moved = self.strategy.engine.begin_step(progress.step)  # healed from a peer group
                if moved:
                    break
                self.profiler.before_step(progress.step + 1)
                self.pace.step_started()
                moved = not self._step(batches)  # a void step: taken again, on its data
                self.profiler.after_step(progress.step)
                last = progress.step == self.total_steps
                # A semi-synchronous engine syncs the groups here (healed: data from there).
                moved = moved or self.strategy.engine.end_step(progress.step, last)
                if moved:
                    break
                self.telemetry.step_done(time.perf_counter() - started)
                self.telemetry.beat(progress.step)
                stopped = self._after_step()
                if stopped:
                    break
            if progress.step < self.total_steps and not stopped and not moved:  # epoch's end
                progress.epoch += 1
                progress.samples_in_epoch = 0
        if self.saved_at != progress.step and spec.checkpoint.enabled:
            self._save()
        else:  # nothing went bad unnoticed, also where log lines are read late (XLA)
            self._check_finite()
        self._finish()

    def _ending(self) -> RunEnd:
        """How the run ended, for the trackers: stopped where it was asked to stop (to be
        resumed) before its last step."""
        stopped = self.stop_requested and self.progress.step < self.total_steps
        best = self.checkpointer.store.best() if self.state.best and self.strategy.is_main else None
        return RunEnd("stopped" if stopped else "finished", str(best.path) if best else None)

    def _after_step(self) -> bool:
        """Logs, evaluates and saves as the spec says; returns whether to stop here."""
        spec, step = self.spec, self.progress.step
        last = step == self.total_steps
        if step % spec.train.log_every == 0 or last:
            self._log()
        every_eval = spec.eval.every_n_steps
        evaluate = every_eval is not None and (step % every_eval == 0 or last)
        # A stop request (a preemption's grace period) does not wait for an evaluation.
        evaluate = evaluate and not self.strategy.control.any_rank(
            self.layout.stop_request.exists()
        )
        best = evaluate and self._evaluate()
        every = spec.checkpoint.every_n_steps
        if spec.checkpoint.enabled and (best or (every and step % every == 0)):
            self._save()
        self.checkpointer.poll()
        # Every rank must agree on the step, or a rank that saw a reason late would wait for
        # the others: the launcher's stop request (a file: Ctrl-C, SIGTERM), a non-finite
        # loss, early stopping. One small all-reduce.
        early = evaluate and self.state.early is not None and self.state.early.should_stop
        requested, bad, early = self.strategy.control.any_rank_each(
            [self.layout.stop_request.exists(), self.state.nonfinite.tripped, early]
        )
        if bad:
            self._stop_nonfinite()
        if early and not last:
            self._say(self.state.early.message())  # type: ignore[union-attr]
        elif requested:
            self._say(f"stop requested: stopping after step {step}")
            self.stop_requested = True
        return requested or early

    def _evaluate(self) -> bool:
        """Evaluates the model; returns whether this is one of the best checkpoints."""
        assert self.evaluator is not None
        step = self.progress.step
        started = time.perf_counter()
        self.telemetry.beat(step, busy=True)  # until its first batch: workers start, XLA compiles
        alive = lambda: self.telemetry.beat(step, busy=True, evaluating=True)  # noqa: E731
        metrics = self.evaluator.run(self.model, step, alive)
        if self.average is not None:
            with self.average.swapped_in():
                averaged = self.evaluator.run(self.model, step, alive)
            metrics.update({"val_ema/" + k.removeprefix("val/"): v for k, v in averaged.items()})
        self.telemetry.beat(step)
        seconds = time.perf_counter() - started
        self.state.window.restart_clock()  # the evaluation is not training throughput
        self.report.evaluation(step, self.progress.epoch, metrics, seconds)
        if self.state.early is not None:
            self.state.early.update(step, metrics)
        best = self.state.best is not None and self.state.best.offer(step, metrics)
        return self.strategy.control.from_main(best)  # a save is collective: rank 0 decides

    def _finish(self) -> None:
        self.profiler.close()
        self.pace.close()
        self.checkpointer.close()
        self.strategy.drain()
        self.memory.update(
            params=memory.local_bytes(self.model.parameters()),
            optimizer=memory.optimizer_bytes(self.optimizer),
            peak_rss=memory.peak_rss_bytes(),
        )
        self.report.finish(
            self.progress.step,
            self.memory,
            {
                **self.strategy.summary(),
                **self.strategy.engine.summary(),
                **(self.stragglers.summary() if self.stragglers else {}),
            },
            best=self.checkpointer.store.best() if self.state.best else None,
            skipped=self.state.nonfinite.skipped,
            # Another replica group's saves may land after this line: it names none.
            last=self.checkpointer.store.latest()
            if self.strategy.engine.saves_checkpoints
            else None,
            written=self.checkpointer.write_times,
        )

    def _step(self, batches: Any) -> bool:
        """One optimizer step; False where it was void (`ReplicaEngine.commit_step`)."""
        accum = self.spec.train.grad_accum_steps
        total_loss: torch.Tensor | None = None
        totals: dict[str, torch.Tensor] = {}
        samples = 0
        for i in range(accum):
            with self.pace.fetching():
                batch = next(batches)
            samples += batch_size(batch)
            last = i == accum - 1
            with self.strategy.sync_gradients(self.model, last), self.speed.counting(batch):
                loss, metrics = self.strategy.steps.forward_backward(
                    self.model, batch, self.loss_of, accum
                )
            self.pace.backward_returned()
            # Accumulate on the device: reading a value here would stall the pipeline.
            loss = loss.detach().float()
            total_loss = loss if total_loss is None else total_loss + loss
            for k, v in metrics.items():
                value = torch.as_tensor(v, device=self.strategy.device).detach().float()
                totals[k] = totals[k] + value if k in totals else value
        if "grads" not in self.memory:
            self.memory["grads"] = memory.local_bytes(p.grad for p in self.model.parameters())
        if waited := self.checkpointer.before_update():
            self.telemetry.checkpoint_blocked(waited, same_save=True)
        assert total_loss is not None
        clip = self.spec.train.grad_clip_norm
        with self.pace.waiting():  # for the other replica groups
            self.strategy.engine.average_gradients(self.model)
        norm = self.strategy.steps.finish_gradients(self.model, self.optimizer, clip)
        with self.pace.waiting():
            committed = self.strategy.engine.commit_step()
        if not committed:
            self.strategy.drop_update(self.optimizer)
            return False
        step = self.progress.step + 1
        applied = self.state.nonfinite.allows_update(step, total_loss, norm)
        if applied:
            with self.pace.updating():
                self.strategy.apply_update(self.optimizer)
            if self.average is not None:
                self.average.update()
        else:
            self.strategy.drop_update(self.optimizer)
        self.pace.step_done()
        self.scheduler.step()
        if accum > 1:
            total_loss, totals = total_loss / accum, {k: v / accum for k, v in totals.items()}
        if norm is not None:  # computed for clipping and the non-finite check anyway
            totals["grad_norm"] = norm.detach().float()
        if applied:  # a skipped step's NaN would spoil the whole window's means
            # Before the step's graph is cut (XLA): the window's sums are part of the step.
            self.state.window.add(total_loss, totals)
        self.strategy.on_step_end(step)
        self.progress.step = step
        # Every replica's shard has the same length (the sampler pads), so the global count is
        # exact, also for a short last batch (data.drop_last: false).
        self.progress.samples_in_epoch += samples * self.strategy.dp_size
        return True

    def _log(self) -> None:
        window = self.state.window
        if not window.steps:  # every update of the window was skipped (train.on_nonfinite)
            return
        self.state.window = MetricsWindow()
        # Collective: every rank's pace in this window, compared once it is logged.
        ranks = self.stragglers.gather(self.pace.window()) if self.stragglers else {}
        self.report.log(
            window,
            self.progress.step,
            self.progress.epoch,
            rates_used(self.spec.optim, self.scheduler, self.grouping.names()),
            self.state.nonfinite.device_record(),
            receive_own=self.state.nonfinite.note,
            pace=by_rank(ranks),
        )
        if self.stragglers:
            found = self.stragglers.judge(ranks, self.progress.step, window.steps)
            if found:
                self._act_on_straggler(self.stragglers, found)

    def _act_on_straggler(self, watch: StragglerWatch, found: Slowness) -> None:
        """`launch.straggler.action`, every rank having judged alike: `stop` saves (a
        collective), then ends the run naming the rank; `restart` ends the processes of the
        straggler's replica group, which its agent restarts."""
        action, step = self.spec.launch.straggler.action, self.progress.step
        if action == "restart" and watch.ours(found):
            raise watch.restart_error(found, step)
        if action != "stop":
            return
        if self.spec.checkpoint.enabled and self.saved_at != step:
            self._save()
        self.checkpointer.close()
        saved = self.checkpointer.store.latest() if self.spec.checkpoint.enabled else None
        raise watch.stop_error(found, step, saved)

    def _save(self) -> None:
        if not self.strategy.engine.saves_checkpoints:  # another replica group saves this one
            self.saved_at = self.progress.step
            return
        started = time.perf_counter()
        # Saving must not move the random streams (XLA advances its seed at every graph cut),
        # or the run would go on drawing other numbers than a run resumed from this save.
        rng = self.strategy.rng.state()
        self._check_finite()
        # The check cut XLA's graph: the checkpoint must record the streams from before it.
        self.strategy.rng.set_state(rng)
        self.telemetry.beat(self.progress.step, busy=True)  # a long save is not a hang
        self.checkpointer.save(self.progress.step)
        self.saved_at = self.progress.step
        self.telemetry.beat(self.progress.step)
        self.strategy.rng.set_state(rng)
        self.telemetry.checkpoint_blocked(time.perf_counter() - started)

    def _check_finite(self) -> None:
        """Collective: a rank that saw a non-finite value stops every rank, unsaved."""
        with self.strategy.phase("check", self.progress.step):
            # Before every save (and the end): what the checkpoint and an export keep.
            self.strategy.steps.agree_buffers(self.model)
            bad = self.state.nonfinite.check_now(self.model)
        if self.strategy.control.any_rank(bad):
            self._stop_nonfinite()

    def _stop_nonfinite(self) -> None:
        """Collective: ends the run with exit 1, naming what went bad and where; the saves
        under way (all of finite weights) are published first."""
        self.checkpointer.close()
        raise self.state.nonfinite.failure(self.checkpointer.store.latest())

    def _say(self, text: str, every_rank: bool = False) -> None:
        self.report.say(text, every_rank)

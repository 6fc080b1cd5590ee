"""The resume, decided once in the `train` process: the run folder, the store its checkpoints
go to, the checkpoint the first attempt starts from, and the spec the run runs with (a
resume's: the checkpoint's own, changed where the user changes it now), with every refusal said
before anything is created.

This is the launcher's one caller of the rule (`launcher.checkpoint.selection.resume_point`),
the damage check (`launcher.checkpoint.damage.refuse_damaged`) and the spec merge
(`launcher.config.resume.spec_on_resume`). `checkpoint.dir` is resolved into a store here, once
(`{run}` filled in), and each store is listed once (`catalog.Listings`): the rule, the choice of
folder, the store's check and the damage check all take that one listing. The plan carries the
decision, and the worker plan hands its store and checkpoint to the workers, who ask the rule
again only when an attempt restarts (`selection.attempt_start`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.checkpoint import folder_choice
from launcher.checkpoint.catalog import Listings
from launcher.checkpoint.damage import refuse_damaged
from launcher.checkpoint.format import read_meta, recorded_spec
from launcher.checkpoint.selection import ResumeRequest, resume_point
from launcher.checkpoint.store import Store, store_at, store_of_run
from launcher.checkpoint.store_check import check_reachable
from launcher.config.loader import SpecLayers
from launcher.config.resume import Change, ResumedSpec, spec_on_resume
from launcher.config.spec import RunSpec
from launcher.errors import UsageError
from launcher.storage_url import location


@dataclass(frozen=True)
class ResumeDecision:
    run_dir: Path  # the folder this launch writes into
    checkpoint: Path | None  # the complete checkpoint the first attempt starts from; None: anew
    spec: RunSpec  # what the run runs with (`checkpoint.dir`: the store, `{run}` filled in)
    store: Store  # where its checkpoints go: `checkpoint.dir`'s store, or the run folder's
    # {dotted key: where its value came from}: spec.yaml's comments (launcher.config.sources)
    sources: dict[str, str] = field(default_factory=dict)
    changes: tuple[Change, ...] = ()  # what a resume changed from the spec its checkpoint recorded
    # The YAML file as this launch read it: each checkpoint records it, so that the next resume
    # tells the keys edited since from those that were not (launcher.config.resume).
    config_file: dict[str, Any] | None = None

    @property
    def said(self) -> tuple[str, ...]:
        """The changes as the launcher says them before the run starts."""
        return tuple(change.describe() for change in self.changes)


def decide_resume(
    spec: RunSpec | None,
    *,
    resume: str | None,
    run_dir: Path | None = None,
    job_id: str | None = None,
    layers: SpecLayers | None = None,
    sources: dict[str, str] | None = None,
) -> ResumeDecision:
    """`spec`: the spec given (`--config`), or None to continue the run or checkpoint folder
    that `resume` names with its own spec; `layers`: what the user gave now (a resume merges it
    onto the checkpoint's spec); `job_id`: a job's id, which names its shared folder."""
    asked: ResumeRequest | Path | None = None
    resumed: ResumedSpec | None = None
    listings = Listings()
    if spec is None:  # the checkpoint first: the run's name and folder come from its spec
        assert layers is not None and resume not in (None, "latest", "best")
        asked = resume_point(ResumeRequest(str(resume), Path.cwd(), ""), listings=listings)
        assert asked is not None
        resumed = _checked(asked, None, layers, listings)
        assert resumed is not None
        spec = resumed.spec
    elif resume:
        output_dir, job = Path(spec.run.output_dir), job_id is not None
        asked = ResumeRequest(resume, output_dir, spec.run.name, job=job)
    chosen, checkpoint, store = _run_and_checkpoint(spec, run_dir, resume, job_id, asked, listings)
    # Without --config, the folder's choice sees to it that this is the checkpoint asked for.
    if checkpoint is not None and (resumed is None or checkpoint != asked):
        resumed = _checked(checkpoint, spec, layers, listings)
    if resumed is None:
        config_file = layers.yaml if layers is not None else None
        spec = _naming_the_store(spec, store)
        return ResumeDecision(chosen, checkpoint, spec, store, dict(sources or {}), (), config_file)
    changes = tuple(resumed.changes)
    spec = _naming_the_store(resumed.spec, store)
    return ResumeDecision(chosen, checkpoint, spec, store, resumed.sources, changes, resumed.yaml)


def _checked(
    checkpoint: Path, spec: RunSpec | None, layers: SpecLayers | None, listings: Listings
) -> ResumedSpec | None:
    """The checkpoint checked whole and, where the user's layers are given, the spec a resume
    runs with: the checkpoint's own, with what the user changes now (else `spec`, as given).
    A change no resume can take is refused, as is a run with no step left to train."""
    # Before anything is read from it; its files as the listing that found it gave them.
    refuse_damaged(checkpoint, listed=listings.files_of(checkpoint))
    meta = read_meta(checkpoint)
    resumed = None
    if layers is not None:
        resumed = spec_on_resume(*recorded_spec(checkpoint, meta), layers)
        _refuse_another_recipe(checkpoint, resumed)
        _refuse_weights_on_resume(checkpoint, layers, resumed)
        spec = resumed.spec
    assert spec is not None
    _check_steps_left(spec, checkpoint, meta.get("step"))
    return resumed


def _refuse_another_recipe(checkpoint: Path, resumed: ResumedSpec) -> None:
    for change in resumed.changes:
        if change.key == "recipe.source" and _another_recipe(change.before, change.after):
            raise UsageError(
                f"recipe.source ({change.origin}): {checkpoint} was trained by "
                f"{change.before}; a resumed run continues with its own recipe",
                hint="Start a new run without --resume to train another recipe.",
            )


def _refuse_weights_on_resume(checkpoint: Path, layers: SpecLayers, resumed: ResumedSpec) -> None:
    """`load.weights` starts a new run; a resumed run goes on from its own checkpoint. A run
    that was started from weights keeps the key as it had it, and never loads them again."""
    origins = [origin for key, value, origin in layers.given if key == "load.weights" and value]
    origins += [c.origin for c in resumed.changes if c.key == "load.weights" and c.after]
    if origins:
        raise UsageError(
            f"load.weights ({origins[0]}): starts a new run from weights, and --resume "
            f"{checkpoint} continues a run from its own checkpoint; give one of them",
            hint="To fine-tune, start a new run (no --resume); to continue this run, leave "
            "load.weights as the run had it.",
        )


def _another_recipe(before: str, after: str) -> bool:
    """Whether a resume names another recipe: another module, or a file of other contents (the
    same recipe moved, or a checkout in another folder, is the same recipe)."""
    old, new = Path(before), Path(after)
    if not (before.endswith(".py") and after.endswith(".py")):
        return before != after
    return old.is_file() and new.is_file() and old.read_bytes() != new.read_bytes()


def _check_steps_left(spec: RunSpec, checkpoint: Path, step: Any) -> None:
    """A resumed run must have steps left to train: one that would start past its end is
    refused before anything starts."""
    end = spec.train.max_steps
    if isinstance(step, int) and end is not None and end <= step:
        raise UsageError(
            f"train.max_steps={end}: the checkpoint it resumes ({checkpoint}) is at step "
            f"{step} already; nothing is left to train",
            hint=f"Raise train.max_steps past {step} (e.g. train.max_steps={2 * step}).",
        )


def _run_and_checkpoint(
    spec: RunSpec,
    run_dir: Path | None,
    resume: str | None,
    job_id: str | None,
    asked: ResumeRequest | Path | None,
    listings: Listings,
) -> tuple[Path, Path | None, Store]:
    """The run folder, the checkpoint the first attempt starts from (`resume_point`) and the
    store; `asked`: what `--resume` asks for, or the checkpoint it named where that was read
    first."""
    output_dir, name = Path(spec.run.output_dir), spec.run.name
    if run_dir is not None:
        folder_choice.check_is_folder(run_dir)
    if job_id is not None:
        run_dir = run_dir or folder_choice.job_run_dir(output_dir, name, job_id)
        folder_choice.refuse_finished_job(run_dir, job_id, listings)  # whatever --resume says
    if isinstance(asked, ResumeRequest):
        asked = resume_point(asked, listings=listings)
    asked = _read_as_the_run(asked, spec)
    if job_id is None:
        if resume == "best" and run_dir is None:
            # The best is rarely the newest: continuing in its folder would overwrite newer
            # checkpoints, so the run branches off into a folder of its own.
            run_dir = folder_choice.new_run_dir(output_dir, name)
        run_dir = folder_choice.own_run(output_dir, name, run_dir, asked, listings)
    elif resume != "latest":  # `latest`: the job's own newest checkpoint, or none yet
        folder_choice.check_job_resume(run_dir, job_id, asked, listings)
    assert run_dir is not None
    store = _take_store(spec, run_dir, job_id, asked, listings)
    return run_dir, resume_point(asked, run_dir, listings), store


def _read_as_the_run(asked: Any, spec: RunSpec) -> Any:
    """A checkpoint in a store, read with the run's storage options (a location's options
    are part of what it is); a folder as it is."""
    if asked is None:
        return None
    return location(str(asked), spec.checkpoint.storage_options, "--resume")


def _take_store(
    spec: RunSpec, run_dir: Path, job_id: str | None, asked: Any, listings: Listings
) -> Store:
    """`checkpoint.dir`, resolved once: the store it names (`{run}` filled in) becomes the
    run folder's once found reachable, or the run folder's own `checkpoints/`. A store that
    holds checkpoints is continued only from its newest (a job's requeue, a resume):
    anything else would mix two runs' checkpoints and prune the other's."""
    url = spec.checkpoint.store_url(run_dir.name)
    if url is None:  # the store a resumed run's folder records (checkpoints off), or its own
        store = store_of_run(run_dir)
        listings.take(run_dir, store)
        return store
    store = store_at(location(url, spec.checkpoint.storage_options, "checkpoint.dir"))
    check_reachable(store)
    newest = listings.of(store).newest
    listings.take(run_dir, store)
    if newest is None or job_id is not None or newest == asked:
        return store
    raise UsageError(
        f"checkpoint.dir {url}: already holds checkpoints up to {newest.name}, which this run "
        "does not continue; writing there would mix two runs",
        hint="Put {run} in checkpoint.dir (a prefix per run), continue that run with --resume "
        f"{newest}, or give another checkpoint.dir.",
    )


def _naming_the_store(spec: RunSpec, store: Store) -> RunSpec:
    """The spec with `checkpoint.dir` as the store it was resolved to (`{run}` filled in):
    spec.yaml, the workers and every checkpoint's record name the store itself, so a resume
    continues in it."""
    if spec.checkpoint.dir is None or not store.remote or spec.checkpoint.dir == str(store.root):
        return spec
    named = spec.checkpoint.model_copy(update={"dir": str(store.root)})
    return spec.model_copy(update={"checkpoint": named})

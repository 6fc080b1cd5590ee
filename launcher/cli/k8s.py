"""`train k8s`: print a Kubernetes manifest (a Kubeflow PyTorchJob or a JobSet)."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Annotated

import typer

from launcher.cli.options import ConfigOpt, DebugOpt, Overrides, print_from_spec
from launcher.clusters.k8s_manifest import DEFAULT_BACKOFF_LIMIT, DEFAULT_GRACE_PERIOD_S

if TYPE_CHECKING:
    from launcher.config.spec import RunSpec


class JobKind(str, Enum):
    pytorchjob = "pytorchjob"
    jobset = "jobset"


def k8s_command(
    config: ConfigOpt,
    nodes: Annotated[int, typer.Option(min=1, help="Pods (nodes) to run.")],
    gpus_per_node: Annotated[int, typer.Option(min=1, help="GPUs per pod.")],
    image: Annotated[str, typer.Option(help="The container image: it holds train and the recipe.")],
    overrides: Overrides = None,
    kind: Annotated[
        JobKind,
        typer.Option(help="pytorchjob: Kubeflow's training operator; jobset: a JobSet."),
    ] = JobKind.pytorchjob,
    pvc: Annotated[
        str | None,
        typer.Option(
            help="An existing ReadWriteMany PersistentVolumeClaim for the run folder. Left "
            "out, the manifest makes one, <job name>-runs.",
            show_default=False,
        ),
    ] = None,
    grace_period: Annotated[
        int,
        typer.Option(
            min=1,
            help="terminationGracePeriodSeconds: seconds a pod has after SIGTERM to finish its "
            "step and save a checkpoint before it is killed.",
        ),
    ] = DEFAULT_GRACE_PERIOD_S,
    backoff_limit: Annotated[
        int,
        typer.Option(
            min=0,
            help="Restarts of the job's pods after a failure or SIGTERM (PyTorchJob: "
            "runPolicy.backoffLimit; JobSet: failurePolicy.maxRestarts).",
        ),
    ] = DEFAULT_BACKOFF_LIMIT,
    debug: DebugOpt = False,
) -> None:
    """Print a Kubernetes manifest that runs this spec on several pods and continues the run
    when a pod is restarted. Apply it with: train k8s ... > job.yaml && kubectl apply -f job.yaml"""

    def job(spec: RunSpec) -> str:
        from launcher.clusters.k8s_manifest import manifest

        return manifest(
            str(config),
            nodes,
            gpus_per_node,
            image,
            spec.run.name,
            kind=kind.value,
            pvc=pvc,
            grace_period=grace_period,
            backoff_limit=backoff_limit,
            extra_args=list(overrides or []),
        )

    print_from_spec(config, overrides, debug, job)

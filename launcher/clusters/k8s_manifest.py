"""A ready Kubernetes manifest that runs `train` on several pods: a Kubeflow PyTorchJob or a
JobSet, with the run folder on a ReadWriteMany volume (`train k8s`).

Each pod runs the same `train --config ... --resume latest`; the node count, its rank and the
rendezvous come from the operator's environment (`kubernetes.py`), and the job's
name names the run folder, so a restarted pod (or a restarted JobSet) continues the run. The
volume is mounted at `/runs` in every pod and the run writes there (`run.output_dir=/runs`):
the spec's own `output_dir` is a path of the machine that wrote the manifest.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Literal

import yaml

from launcher.config.spec import RUN_NAME_PATTERN
from launcher.config.yaml_file import echo
from launcher.errors import UsageError

Kind = Literal["pytorchjob", "jobset"]
DEFAULT_GRACE_PERIOD_S = 300
DEFAULT_BACKOFF_LIMIT = 10
RUNS_MOUNT = "/runs"  # where the volume goes in every pod, and the run's output_dir there
PYTORCHJOB_PORT = 23456  # the training operator's default port, named pytorchjob-port
_NOT_IN_NAME = re.compile(r"[^a-z0-9-]+")
_CONTROLLER = {"pytorchjob": "Kubeflow's training operator", "jobset": "the JobSet controller"}

# The header's comments hold fixed text and values checked to a safe set of characters only
# (`_in_comment`): a comment is text, and a newline in it would start a document of its own.
_HEADER = """\
# {what} for run {run}: {nodes:d} node(s) x {gpus:d} GPU(s), written by `train k8s`.
# Apply it with:  kubectl apply -f {name}.yaml
# ({needs} must run in the cluster).
#
# The run folder is {folder}/{run}/{name} on the PersistentVolumeClaim {pvc}, mounted at
# {folder} in every pod (run.output_dir={folder}, whatever the spec says on this machine).
# The claim must be ReadWriteMany (NFS, CephFS, EFS, Filestore, Azure Files...): every pod
# writes the same checkpoints. Before the first step, train checks that every node sees the
# run folder, and stops (exit 2) if one does not.
# The image must hold `train` and the recipe, and the config must be at {config} (in the
# image, or on a volume mounted there): the command reads it there.
# On SIGTERM (a pod deleted or preempted) every rank finishes its step and saves within the
# grace period ({grace:d} s), train exits with 143, and the job restarts its pods (up to
# {restarts:d} times); they continue the run from its newest checkpoint (--resume latest).
"""

# What Kubernetes takes (k8s.io/apimachinery's validation): a claim's name is a DNS-1123
# subdomain; a PyTorchJob's or JobSet's name a DNS-1035 label (it starts pods' host names).
_DNS_1123_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_DNS_1123_SUBDOMAIN = re.compile(rf"{_DNS_1123_LABEL}(?:\.{_DNS_1123_LABEL})*")
_DNS_1035_LABEL = re.compile(r"[a-z](?:[-a-z0-9]*[a-z0-9])?")
# An image reference, as github.com/distribution/reference parses one: [host[:port]/]path
# [:tag][@digest].
_HOST_PART = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_HOST = rf"(?:{_HOST_PART}(?:\.{_HOST_PART})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_IMAGE = re.compile(
    rf"(?:{_HOST}/)?{_PATH_PART}(?:/{_PATH_PART})*(?::\w[\w.-]{{0,127}})?(?:@{_DIGEST})?",
    re.ASCII,
)
_RUN_NAME = re.compile(RUN_NAME_PATTERN)
_SAFE_IN_COMMENT = re.compile(r"[A-Za-z0-9._/+=@:,~-]+", re.ASCII)


def manifest(
    config: str,
    nodes: int,
    gpus_per_node: int,
    image: str,
    run_name: str,
    *,
    kind: Kind = "pytorchjob",
    pvc: str | None = None,
    grace_period: int = DEFAULT_GRACE_PERIOD_S,
    backoff_limit: int = DEFAULT_BACKOFF_LIMIT,
    extra_args: list[str] | None = None,
) -> str:
    """The manifest's YAML text: comments that say how to apply it, then the volume's claim
    (unless `pvc` names an existing one) and the job. Every value is data for the YAML
    writer; those Kubernetes restricts are checked first (`UsageError`, naming the flag or
    key)."""
    _check_inputs(image, run_name, pvc)
    name = job_name(run_name)
    claim = pvc or f"{name}-runs"
    command = _command(config, gpus_per_node, extra_args or [])
    pod = _pod(command, image, gpus_per_node, claim, RUNS_MOUNT, grace_period, kind)
    job = (
        _pytorchjob(name, nodes, pod, backoff_limit)
        if kind == "pytorchjob"
        else _jobset(name, nodes, pod, backoff_limit)
    )
    documents = [job] if pvc else [_claim(claim), job]
    header = _HEADER.format(
        what="Kubeflow PyTorchJob" if kind == "pytorchjob" else "JobSet",
        run=run_name,
        nodes=nodes,
        gpus=gpus_per_node,
        needs=_CONTROLLER[kind],
        name=name,
        folder=RUNS_MOUNT,
        pvc=claim,
        config=_in_comment(config, "the path the command gives"),
        grace=grace_period,
        restarts=backoff_limit,
    )
    return header + yaml.safe_dump_all(documents, sort_keys=False, explicit_start=True)


def _command(config: str, gpus_per_node: int, extra_args: list[str]) -> list[str]:
    """Every pod's command, as a list: the YAML writer quotes each argument as it must. The
    run writes on the volume; an override of `run.output_dir` given to `train k8s` names a
    folder of this machine, and is left out."""
    args = ["--accelerator", "gpu", "--devices", str(gpus_per_node), "--resume", "latest"]
    overrides = [a for a in extra_args if a.partition("=")[0].strip() != "run.output_dir"]
    return ["train", "--config", config, *args, f"run.output_dir={RUNS_MOUNT}", *overrides]


def _check_inputs(image: str, run_name: str, pvc: str | None) -> None:
    """What Kubernetes (or a pod's command line) cannot take, refused by the flag or key that
    gave it."""
    if pvc is not None and not (len(pvc) <= 253 and _DNS_1123_SUBDOMAIN.fullmatch(pvc)):
        raise UsageError(
            f"--pvc {echo(pvc)}: not a PersistentVolumeClaim name; Kubernetes takes lower-case "
            "letters, digits, '-' and '.' (a DNS-1123 subdomain: at most 253 characters, "
            "starting and ending with a letter or digit)",
            hint="Give the claim's name as `kubectl get pvc` lists it.",
        )
    if not (len(image) <= 255 and _IMAGE.fullmatch(image)):
        raise UsageError(
            f"--image {echo(image)}: not a container image reference, "
            "[REGISTRY[:PORT]/]PATH[:TAG][@DIGEST] (lower-case path, no spaces or control "
            "characters)",
            hint="e.g. --image ghcr.io/lab/train:1",
        )
    if not _RUN_NAME.fullmatch(run_name):  # the spec refuses it too; this is what names the job
        raise UsageError(
            f"run.name {echo(run_name)}: the job is named after it, so use letters, digits, '.', "
            "'_' and '-', starting with a letter or digit"
        )


def _in_comment(value: str, otherwise: str) -> str:
    """`value` where it is plain enough for a comment line (letters, digits and path
    punctuation), else a fixed description of it: no value can end the comment."""
    return value if _SAFE_IN_COMMENT.fullmatch(value) else f"<{otherwise}>"


def job_name(run_name: str) -> str:
    """The run's name as a Kubernetes name: pods' host names are built from it, so lower case
    letters, digits and '-', starting with a letter, short enough for `-worker-NNN`."""
    name = _NOT_IN_NAME.sub("-", run_name.lower()).strip("-")
    if not name[:1].isalpha():
        name = f"run-{name}".rstrip("-")
    name = name[:40].rstrip("-")
    assert _DNS_1035_LABEL.fullmatch(name), name  # what PyTorchJob and JobSet names must be
    return name


def _claim(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name},
        "spec": {
            # Every pod mounts it at once, read and write; the storage class must allow it.
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": "100Gi"}},
        },
    }


def _pod(
    command: list[str],
    image: str,
    gpus: int,
    claim: str,
    mount: str,
    grace_period: int,
    kind: Kind,
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "pytorch",  # the training operator looks for a container of this name
        "image": image,
        "command": command,
        "resources": {"requests": {"nvidia.com/gpu": gpus}, "limits": {"nvidia.com/gpu": gpus}},
        "volumeMounts": [
            {"name": "runs", "mountPath": mount},
            # DataLoader workers hand batches over in shared memory; a container's default
            # /dev/shm (64 MiB) is too small for them.
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    if kind == "pytorchjob":
        container["ports"] = [{"name": "pytorchjob-port", "containerPort": PYTORCHJOB_PORT}]
    else:
        container["env"] = _jobset_env()
    return {
        "spec": {
            # Time for every rank to finish its step and save after SIGTERM, before SIGKILL.
            "terminationGracePeriodSeconds": grace_period,
            **({"restartPolicy": "Never"} if kind == "jobset" else {}),
            "containers": [container],
            "volumes": [
                {"name": "runs", "persistentVolumeClaim": {"claimName": claim}},
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            ],
        }
    }


def _jobset_env() -> list[dict[str, Any]]:
    """A JobSet says nothing of the node count, and its name is a label: the launcher reads
    both from the environment (JOB_COMPLETION_INDEX, the node rank, Kubernetes sets itself)."""
    label = "metadata.labels['jobset.sigs.k8s.io/jobset-name']"
    return [
        {"name": "JOBSET_NAME", "valueFrom": {"fieldRef": {"fieldPath": label}}},
    ]


def _pytorchjob(name: str, nodes: int, pod: dict[str, Any], backoff_limit: int) -> dict[str, Any]:
    def replicas(count: int) -> dict[str, Any]:
        # OnFailure: a pod whose train exits non-zero (143 after SIGTERM) is started again.
        return {"replicas": count, "restartPolicy": "OnFailure", "template": pod}

    specs = {"Master": replicas(1)}
    if nodes > 1:  # a copy: the YAML shows each in full, not as an alias of the other
        specs["Worker"] = {**replicas(nodes - 1), "template": copy.deepcopy(pod)}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": {"runPolicy": {"backoffLimit": backoff_limit}, "pytorchReplicaSpecs": specs},
    }


def _jobset(name: str, nodes: int, pod: dict[str, Any], backoff_limit: int) -> dict[str, Any]:
    env = pod["spec"]["containers"][0]["env"]
    env.append({"name": "PET_NNODES", "value": str(nodes)})
    job = {
        "parallelism": nodes,
        "completions": nodes,
        "completionMode": "Indexed",
        # One failed pod fails its Job, and the JobSet then restarts every pod together.
        "backoffLimit": 0,
        "template": pod,
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": {"maxRestarts": backoff_limit},
            # Pods get stable names under a headless service: pod 0 hosts the rendezvous.
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": job}}],
        },
    }

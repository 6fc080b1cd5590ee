"""Kubernetes and SkyPilot: the nodes a pod's environment describes, two "pods" that train
and resume with nothing but that environment, and the manifests `train k8s` prints."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher.cli.run import with_operator_devices
from launcher.clusters.k8s_manifest import job_name, manifest
from launcher.clusters.kubernetes import from_environment
from launcher.clusters.nodes import Nodes, resolve_nodes
from launcher.config.loader import cli_layers, spec_from_layers
from launcher.errors import UsageError
from tests.clusters.test_slurm import SRUN_ENV
from tests.conftest import (
    REPO,
    finish_train,
    free_port,
    metrics_of,
    wait_for_step,
    write_spec,
)
from tests.forked_train import fork_train, train_in_fork

# What Kubeflow's training operator sets in the pods of a 4-pod PyTorchJob `gpt` (v1, and with
# nprocPerNode: torchrun's PET_* as well, where WORLD_SIZE counts processes).
PYTORCHJOB_V1 = {
    "MASTER_ADDR": "gpt-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "4",
    "RANK": "2",
    "HOSTNAME": "gpt-worker-1",
    "PYTHONUNBUFFERED": "0",
}
PET = {
    "PET_NNODES": "4",
    "PET_NODE_RANK": "2",
    "PET_NPROC_PER_NODE": "8",
    "PET_MASTER_ADDR": "gpt-master-0",
    "PET_MASTER_PORT": "23456",
}
# A TrainJob `llm` (Kubeflow Trainer v2): torchrun's variables only.
TRAINJOB = {
    "PET_NNODES": "2",
    "PET_NODE_RANK": "1",
    "PET_NPROC_PER_NODE": "auto",
    "PET_MASTER_ADDR": "llm-node-0-0.llm",
    "PET_MASTER_PORT": "29400",
    "JOB_COMPLETION_INDEX": "1",
    "HOSTNAME": "llm-node-0-1",
}
SKYPILOT = {
    "SKYPILOT_NODE_RANK": "1",
    "SKYPILOT_NUM_NODES": "2",
    "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n",
    "SKYPILOT_TASK_ID": "sky-managed-2026-11-26-12-00-00-000001_gpt_1-0",
}
JOBSET_FQDN = "gpt-node-0-3.gpt.team.svc.cluster.local"


def jobset_pod(**extra: str) -> dict[str, str]:
    return {"JOB_COMPLETION_INDEX": "3", "JOBSET_NAME": "gpt", **extra}


def test_each_operator_gives_nodes_rank_rendezvous_and_the_job_name() -> None:
    def nodes(env: dict[str, str], fqdn: str = "") -> tuple[object, ...]:
        found = resolve_nodes(env=env, fqdn=lambda: fqdn)
        return (found.max, found.node_rank, found.endpoint, found.job_id, found.source)

    assert nodes(PYTORCHJOB_V1) == (4, 2, "gpt-master-0:23456", "gpt", "Kubeflow PyTorchJob gpt")
    # torchrun's variables first: with nprocPerNode, WORLD_SIZE counts processes, not pods.
    with_pet = {**PYTORCHJOB_V1, **PET, "WORLD_SIZE": "32"}
    assert nodes(with_pet) == (4, 2, "gpt-master-0:23456", "gpt", "Kubeflow PyTorchJob gpt")
    assert resolve_nodes(env=with_pet).devices == 8  # the pod's processes, unless --devices
    assert nodes(TRAINJOB) == (2, 1, "llm-node-0-0.llm:29400", "llm", "Kubeflow TrainJob llm")
    assert resolve_nodes(env=TRAINJOB).devices is None  # `auto`: --devices/launch.devices say
    # A JobSet: pod 0's stable name under the same headless service hosts the rendezvous.
    assert nodes(jobset_pod(PET_NNODES="4"), JOBSET_FQDN) == (
        4,
        3,
        "gpt-node-0-0.gpt.team.svc.cluster.local:29500",
        "gpt",
        "JobSet gpt",
    )
    indexed = {"JOB_COMPLETION_INDEX": "1", "PET_NNODES": "2", "MASTER_PORT": "3000"}
    assert nodes(indexed, "train-1.svc-a.ns.svc.cluster.local") == (
        2,
        1,
        "train-0.svc-a.ns.svc.cluster.local:3000",
        "train",
        "Indexed Job train",
    )
    task = "sky-managed-2026-11-26-12-00-00-000001_gpt_1-0"
    assert nodes(SKYPILOT) == (2, 1, "10.0.0.5:29500", task, f"SkyPilot task {task}")
    # Every pod knows it will be restarted by its exit code; a SLURM node does not.
    assert resolve_nodes(env=PYTORCHJOB_V1).restarted_by_exit_code
    assert not resolve_nodes(env=SRUN_ENV).restarted_by_exit_code


def test_flags_win_and_nothing_is_found_outside_a_cluster() -> None:
    flags = resolve_nodes("2", "1", "10.1.1.1:7000", "mine", env=PYTORCHJOB_V1)
    assert (flags.max, flags.node_rank, flags.endpoint, flags.job_id) == (
        2,
        1,
        "10.1.1.1:7000",
        "mine",
    )
    # A variable or two left in a shell is no cluster; neither is nothing at all.
    assert from_environment({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1"}) is None
    assert from_environment({}) is None
    assert resolve_nodes(env={"MASTER_ADDR": "10.0.0.1", "RANK": "0"}) == Nodes()
    # A pod of one: no rendezvous, but the job still names its folder for a restarted pod.
    one = resolve_nodes(env={**PYTORCHJOB_V1, "WORLD_SIZE": "1", "RANK": "0"})
    assert (one.multi, one.job_id, one.source) == (False, "gpt", "Kubeflow PyTorchJob gpt")


@pytest.mark.parametrize(
    ("flags", "overrides", "devices"),
    [({}, [], 8), ({"devices": "3"}, [], 3), ({}, ["launch.devices=2"], 2)],
)
def test_the_operators_processes_per_pod_come_over_the_file_and_under_flags(
    tmp_path: Path, flags: dict[str, str], overrides: list[str], devices: int
) -> None:
    spec = write_spec(tmp_path / "run.yaml", launch={"devices": 1})
    pod = resolve_nodes(env={**PYTORCHJOB_V1, **PET})
    layers = with_operator_devices(cli_layers(spec, overrides, **flags), pod)
    resolved, sources = spec_from_layers(layers, torch_checks=False)
    assert resolved.launch.devices == devices
    if devices == 8:
        assert sources["launch.devices"].startswith("PET_NPROC_PER_NODE (Kubeflow PyTorchJob gpt)")


def test_pet_nproc_per_node_alone_is_the_processes_per_node_as_torchrun_reads_it() -> None:
    """It was read only with a Kubeflow job's other variables, and silently ignored alone
    (issue 52): a one-pod PyTorchJob, or a user used to torchrun, sets it on its own."""
    alone = resolve_nodes(env={"PET_NPROC_PER_NODE": "3"})
    assert (alone.multi, alone.devices, alone.source) == (False, 3, "")
    # So do the other operators' pods, which never set it themselves.
    jobset = jobset_pod(PET_NNODES="4", PET_NPROC_PER_NODE="2")
    assert resolve_nodes(env=jobset, fqdn=lambda: JOBSET_FQDN).devices == 2
    assert resolve_nodes(env={**SKYPILOT, "PET_NPROC_PER_NODE": "4"}).devices == 4


@pytest.mark.timeout(60)
def test_validate_checks_the_devices_pet_nproc_per_node_gives(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml", launch={"devices": 1})
    alone = {"PET_NPROC_PER_NODE": "3"}
    validate = ["validate", "--config", str(spec), "--explain"]
    result = train_in_fork(validate, tmp_path, env=alone)
    assert result.returncode == 0, result.stderr
    assert "at 3 devices x 8" in result.stdout, result.stdout
    assert re.search(r"launch\.devices +3 +PET_NPROC_PER_NODE \(over ", result.stdout)
    flag = train_in_fork([*validate, "--devices", "2"], tmp_path, env=alone)
    assert "at 2 devices x 8" in flag.stdout, flag.stdout + flag.stderr
    refused = train_in_fork(validate, tmp_path, env={"PET_NPROC_PER_NODE": "lots"})
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith("error: PET_NPROC_PER_NODE='lots': expected"), refused.stderr


def test_an_indexed_job_without_a_node_count_is_refused_naming_the_flag() -> None:
    with pytest.raises(UsageError) as refused:
        resolve_nodes(env=jobset_pod(), fqdn=lambda: JOBSET_FQDN)
    assert refused.value.exit_code == 2
    assert "--nnodes: needed in JobSet gpt" in refused.value.render()
    assert resolve_nodes("4", env=jobset_pod(), fqdn=lambda: JOBSET_FQDN).max == 4
    # Without a job name to go by, the folder's name must be given.
    with pytest.raises(UsageError, match=r"--rdzv-id: needed with --nnodes 2 \(MASTER_ADDR"):
        resolve_nodes(
            env={
                **PYTORCHJOB_V1,
                "MASTER_ADDR": "10.0.0.1",
                "HOSTNAME": "x",
                "WORLD_SIZE": "2",
                "RANK": "0",
            }
        )


@pytest.mark.timeout(300)
def test_two_pods_train_stop_on_sigterm_and_restarted_pods_resume(tmp_path: Path) -> None:
    """Two "pods" of a PyTorchJob `demo` with nprocPerNode: 1, both on this machine: `train
    --config run.yaml --resume latest` with only what the operator sets (and the pod's
    HOSTNAME), no --nnodes, --node-rank or --rdzv-* flags."""
    spec = write_spec(
        tmp_path / "run.yaml",  # launch.devices: 2, which PET_NPROC_PER_NODE overrides
        train={"max_steps": 200, "log_every": 50},
        checkpoint={"every_n_steps": 1000},  # the only checkpoint is SIGTERM's
    )
    port = str(free_port())
    job = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2"}
    job |= {"PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port, "PET_NNODES": "2"}
    job |= {"PET_NPROC_PER_NODE": "1"}
    pods = [
        {"RANK": str(rank), "PET_NODE_RANK": str(rank), "HOSTNAME": host}
        for rank, host in enumerate(["demo-master-0", "demo-worker-0"])
    ]
    command = ["--config", str(spec), "--resume", "latest"]

    def start_pods() -> list[Any]:
        # The worker first: it waits for the master, which hosts the rendezvous.
        started = [fork_train(command, tmp_path, {**job, **pods[1]})]
        return [fork_train(command, tmp_path, {**job, **pods[0]}), *started]

    def finish(procs: list[Any]) -> list[Any]:
        for proc in procs:
            proc.wait(150)  # leftovers are looked for once both have ended
        return [finish_train(proc, tmp_path, timeout=5) for proc in procs]

    run_dir = tmp_path / "runs" / "t" / "demo"  # named after the job
    procs = start_pods()
    wait_for_step(run_dir, 1, 5, procs[1])
    os.kill(procs[0].pid, signal.SIGTERM)  # the kubelet signals the container's PID 1
    master, worker = finish(procs)
    output = master.stdout + worker.stdout
    assert "from Kubeflow PyTorchJob demo" in master.stdout and "ddp on 2 x cpu" in output
    spec_yaml = (run_dir / "spec.yaml").read_text()
    assert "devices: 1  # PET_NPROC_PER_NODE (Kubeflow PyTorchJob demo)" in spec_yaml, spec_yaml
    # Both exit 143: a pod that exited 0 would count as done and never be started again.
    assert (master.returncode, worker.returncode) == (143, 143), output + master.stderr
    saved = [p.name for p in (run_dir / "checkpoints").iterdir()]
    assert len(saved) == 1, saved
    assert f"stopped by SIGTERM; saved {run_dir / 'checkpoints' / saved[0]}" in master.stdout
    step = int(saved[0].removeprefix("step-"))
    assert 5 <= step < 200

    master, worker = finish(start_pods())  # the restarted pods: the same command and env
    output = master.stdout + worker.stdout
    assert (master.returncode, worker.returncode) == (0, 0), output + master.stderr
    assert output.count(f"resumed at step {step}") == 2, output
    assert (run_dir / "checkpoints" / "step-00000200" / "COMPLETE").is_file()
    assert [r["step"] for r in metrics_of(run_dir)] == [50, 100, 150, 200]
    assert [p.name for p in run_dir.parent.iterdir()] == ["demo"]  # one run folder


# --- the manifests ------------------------------------------------------------------------

# Imported in the tests, not here: only .venv has them, and the other torch versions' suites
# collect this file too.
CRD_FIELDS = json.loads((REPO / "tests" / "data" / "k8s_crd_fields.schema.json").read_text())


def check_manifest(documents: list[dict[str, Any]]) -> None:
    """Core kinds against Kubernetes' own schema (strict: no unknown field); PyTorchJob and
    JobSet against their CRDs' fields we use, with the pod templates and Job specs inside
    them against Kubernetes' schema too."""
    import jsonschema
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    for doc in documents:
        if doc["kind"] in {"PyTorchJob", "JobSet"}:
            jsonschema.validate(doc, {"$ref": f"#/$defs/{doc['kind']}", **CRD_FIELDS})
        else:
            kubernetes_validate.validate(doc, version, strict=True)
        if doc["kind"] == "PyTorchJob":
            for replicas in doc["spec"]["pytorchReplicaSpecs"].values():
                core = {"apiVersion": "v1", "kind": "PodTemplate", "template": replicas["template"]}
                kubernetes_validate.validate({**core, "metadata": {"name": "x"}}, version, True)
        if doc["kind"] == "JobSet":
            for replicated in doc["spec"]["replicatedJobs"]:
                core = {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "spec": replicated["template"]["spec"],
                }
                kubernetes_validate.validate({**core, "metadata": {"name": "x"}}, version, True)


def test_train_k8s_prints_a_manifest_that_kubernetes_would_take(tmp_path: Path) -> None:
    # This machine's absolute output_dir, given again as an override: in the pods the run
    # writes on the volume, at /runs, wherever the spec wrote on this machine.
    local = str(tmp_path / "runs")
    write_spec(tmp_path / "run.yaml", run={"name": "GPT_ddp.v2", "output_dir": local})
    args = ["k8s", "--config", "run.yaml", "--nodes", "4", "--gpus-per-node", "8"]
    overrides = ["optim.lr=0.1", f"run.output_dir={local}"]
    result = train_in_fork([*args, "--image", "ghcr.io/lab/train:1", *overrides], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == manifest(
        "run.yaml", 4, 8, "ghcr.io/lab/train:1", "GPT_ddp.v2", extra_args=overrides
    )
    assert local not in result.stdout
    assert "# The run folder is /runs/GPT_ddp.v2/gpt-ddp-v2 on the PersistentVolumeClaim" in (
        result.stdout
    )
    assert result.stdout.startswith("# Kubeflow PyTorchJob for run GPT_ddp.v2")
    assert "kubectl apply -f gpt-ddp-v2.yaml" in result.stdout
    assert "must be ReadWriteMany" in result.stdout
    claim, job = yaml.safe_load_all(result.stdout)
    check_manifest([claim, job])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert job["metadata"]["name"] == "gpt-ddp-v2" and job["spec"]["runPolicy"] == {
        "backoffLimit": 10
    }
    master, worker = (job["spec"]["pytorchReplicaSpecs"][k] for k in ("Master", "Worker"))
    assert (master["replicas"], worker["replicas"]) == (1, 3)
    assert master["restartPolicy"] == "OnFailure" and master["template"] == worker["template"]
    pod = master["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 300
    container = pod["containers"][0]
    assert container["command"] == [
        "train", "--config", "run.yaml", "--accelerator", "gpu", "--devices", "8",
        "--resume", "latest", "run.output_dir=/runs", "optim.lr=0.1",
    ]  # fmt: skip
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert {m["mountPath"]: m["name"] for m in container["volumeMounts"]} == {
        "/runs": "runs",
        "/dev/shm": "dshm",
    }
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["runs"]["persistentVolumeClaim"] == {"claimName": "gpt-ddp-v2-runs"}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}


def test_a_jobset_manifest_on_a_volume_of_ones_own() -> None:
    text = manifest(
        "/cfg/run.yaml", 2, 4, "img:1", "gpt", kind="jobset", pvc="team-nfs",
        grace_period=900, backoff_limit=3,
    )  # fmt: skip
    documents = list(yaml.safe_load_all(text))
    assert [d["kind"] for d in documents] == ["JobSet"]  # the claim is the user's own
    check_manifest(documents)
    jobset = documents[0]["spec"]
    assert jobset["failurePolicy"] == {"maxRestarts": 3}
    job = jobset["replicatedJobs"][0]["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (2, 2, "Indexed")
    pod = job["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 900
    container = pod["containers"][0]
    assert container["command"][-3:] == ["--resume", "latest", "run.output_dir=/runs"]
    assert {"name": "runs", "mountPath": "/runs"} in container["volumeMounts"]
    env = {e["name"]: e for e in container["env"]}
    assert env["PET_NNODES"]["value"] == "2"
    # What a pod of it sees (its env, and its host name under the JobSet's service) is
    # what the launcher reads: node count, rank, pod 0, and the JobSet's name.
    pod_env = {"JOB_COMPLETION_INDEX": "1", "JOBSET_NAME": "gpt", "PET_NNODES": "2"}
    nodes = resolve_nodes(env=pod_env, fqdn=lambda: "gpt-node-0-1.gpt.default.svc.cluster.local")
    assert (nodes.max, nodes.node_rank, nodes.job_id) == (2, 1, "gpt")
    assert nodes.endpoint == "gpt-node-0-0.gpt.default.svc.cluster.local:29500"


@pytest.mark.parametrize(
    ("where", "field", "misspelled"),
    [
        (
            ("spec", "pytorchReplicaSpecs", "Master", "template", "spec"),
            "terminationGracePeriodSeconds",
            "terminationGracePeriodSecond",
        ),
        (("spec", "runPolicy"), "backoffLimit", "backofLimit"),
        (("spec", "pytorchReplicaSpecs", "Master"), "restartPolicy", "restartPolicies"),
    ],
)
def test_a_misspelled_field_fails_the_check(
    where: tuple[str, ...], field: str, misspelled: str
) -> None:
    """Kubernetes' own schema for the pod (strict), the CRD's fields for the job."""
    _, job = yaml.safe_load_all(manifest("run.yaml", 2, 8, "img", "gpt"))
    broken = copy.deepcopy(job)
    parent = broken
    for key in where:
        parent = parent[key]
    parent[misspelled] = parent.pop(field)
    check_manifest([job])  # as printed: it passes
    import jsonschema
    import kubernetes_validate

    with pytest.raises(
        (kubernetes_validate.ValidationError, jsonschema.ValidationError), match=misspelled
    ):
        check_manifest([broken])


def test_job_names_are_kubernetes_names() -> None:
    assert job_name("GPT_ddp.v2") == "gpt-ddp-v2"
    assert job_name("7b-run") == "run-7b-run"
    assert len(job_name("x" * 128)) == 40


# --- what the operators set, malformed ------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({**SKYPILOT, "SKYPILOT_NODE_IPS": " \n"}, "SKYPILOT_NODE_IPS=' \\n': expected on its"),
        ({**SKYPILOT, "SKYPILOT_NODE_IPS": "10.0.0.5:22\n"}, "SKYPILOT_NODE_IPS='10.0.0.5:22\\n'"),
        ({**SKYPILOT, "SKYPILOT_NUM_NODES": "two"}, "SKYPILOT_NUM_NODES='two'"),
        ({**SKYPILOT, "SKYPILOT_NUM_NODES": "1:2"}, "SKYPILOT_NUM_NODES='1:2'"),
        (
            {**SKYPILOT, "SKYPILOT_NODE_RANK": "2"},
            "SKYPILOT_NODE_RANK='2': expected this node's rank: 0 or more and below "
            "SKYPILOT_NUM_NODES=2",
        ),
        ({**SKYPILOT, "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
        ({**PYTORCHJOB_V1, "WORLD_SIZE": "-1"}, "WORLD_SIZE='-1'"),
        ({**PYTORCHJOB_V1, "RANK": "abc"}, "RANK='abc'"),
        ({**PYTORCHJOB_V1, "MASTER_PORT": "99999"}, "MASTER_PORT='99999'"),
        ({**PYTORCHJOB_V1, "MASTER_ADDR": "gpt master"}, "MASTER_ADDR='gpt master'"),
        ({**PET, "PET_NNODES": "1:2:3"}, "PET_NNODES='1:2:3'"),
        ({**PET, "PET_NNODES": "3:2"}, "PET_NNODES='3:2': expected a node count"),  # not --nnodes
        ({**PET, "PET_NNODES": " 4"}, "PET_NNODES=' 4'"),  # int() takes it; nobody means it
        ({**PET, "PET_NODE_RANK": "9" * 5000}, "PET_NODE_RANK='9999"),  # past int()'s digits
        ({**PET, "PET_NPROC_PER_NODE": "lots"}, "PET_NPROC_PER_NODE='lots'"),
        ({**PET, "PET_NPROC_PER_NODE": "0"}, "PET_NPROC_PER_NODE='0'"),
        ({"PET_NPROC_PER_NODE": "lots"}, "PET_NPROC_PER_NODE='lots'"),  # alone, as torchrun's
        ({**jobset_pod(PET_NNODES="4"), "JOB_COMPLETION_INDEX": "²"}, "JOB_COMPLETION_INDEX='²'"),
    ],
)
def test_a_malformed_variable_is_refused_by_its_name(env: dict[str, str], named: str) -> None:
    """Each was a traceback (IndexError, ValueError), or an error naming a flag nobody gave."""
    with pytest.raises(UsageError) as refused:
        resolve_nodes(env=env, fqdn=lambda: JOBSET_FQDN)
    assert refused.value.message.startswith(named), refused.value.message


def test_a_rank_past_a_flags_count_names_the_rank_variable() -> None:
    """JOB_COMPLETION_INDEX=5 with --nnodes 4 was "--node-rank 5", a flag nobody gave."""
    with pytest.raises(UsageError) as refused:
        resolve_nodes("4", env=jobset_pod(JOB_COMPLETION_INDEX="5"), fqdn=lambda: JOBSET_FQDN)
    assert refused.value.message == (
        "JOB_COMPLETION_INDEX='5': expected this node's rank: 0 or more and below --nnodes 4"
    )


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("2", "²"), "--node-rank ²: expected 0 to 1"),
        (("2", "0", "h:²"), "--rdzv-endpoint h:²"),
    ],
)
def test_a_superscript_digit_in_a_flag_is_refused(flags: tuple[str, ...], named: str) -> None:
    """str.isdigit() takes "²", which int() refuses: that was a ValueError's traceback."""
    with pytest.raises(UsageError) as refused:
        resolve_nodes(*flags, job_id="j", env={})
    assert refused.value.message.startswith(named), refused.value.message


def test_the_operators_own_words_and_addresses_are_taken() -> None:
    assert resolve_nodes(env={**PET, "PET_NPROC_PER_NODE": "gpu"}).devices is None
    assert resolve_nodes(env={**PET, "PET_NNODES": "2:4", "PET_NODE_RANK": "3"}).max == 4
    ipv6 = resolve_nodes(env={**SKYPILOT, "SKYPILOT_NODE_IPS": "fd00::5\nfd00::6"})
    assert ipv6.endpoint == "fd00::5:29500"


@pytest.mark.timeout(60)
def test_a_blank_skypilot_node_list_is_one_line_naming_it(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml")
    result = train_in_fork(
        ["--config", str(spec)], tmp_path, timeout=40, env={**SKYPILOT, "SKYPILOT_NODE_IPS": "\n"}
    )
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr.startswith("error: SKYPILOT_NODE_IPS='\\n': expected"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()

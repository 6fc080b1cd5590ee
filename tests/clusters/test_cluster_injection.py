"""What `train k8s` and `train slurm` write holds a user's values as data, never as text:
hostile paths, names and overrides parsed back give exactly the documents, keys, lines and
arguments of a plain manifest or script, and what the cluster cannot take is refused by the
flag or key that gave it (issue 39, item 1)."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher.clusters.k8s_manifest import manifest
from launcher.clusters.slurm import sbatch_script
from launcher.errors import UsageError
from tests.clusters.test_kubernetes import check_manifest
from tests.conftest import REPO, usage_error, write_spec
from tests.forked_train import train_in_fork

# A second document, a key of the pod's, a comment's end and a shell's command: whatever a
# value could break out into.
POD = "apiVersion: v1\nkind: Pod\nmetadata: {name: pwn}\nspec: {containers: [{name: x}]}"
BREAKOUTS = [
    f"data\n---\n{POD}\n#",
    "data\n  readOnly: true",
    "data # comment\nkind: Pod",
    "x'; touch pwned; '",
    "$(touch pwned) `touch pwned`",
    "a\r\n#SBATCH --requeue=no",
    "\u2028---\u2028kind: Pod",
]


def _key_paths(node: Any, path: tuple[Any, ...] = ()) -> set[tuple[Any, ...]]:
    """Every key (and list index) in a document: what a value must not add to or take from."""
    if isinstance(node, dict):
        return {path} | {p for k, v in node.items() for p in _key_paths(v, (*path, k))}
    if isinstance(node, list):
        return {path} | {p for i, v in enumerate(node) for p in _key_paths(v, (*path, i))}
    return {path}


def _comments(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#")]


@pytest.mark.parametrize("kind", ["pytorchjob", "jobset"])
@pytest.mark.parametrize("hostile", BREAKOUTS)
def test_a_manifest_holds_hostile_paths_and_overrides_as_values(kind: str, hostile: str) -> None:
    plain = manifest("run.yaml", 2, 8, "img:1", "gpt", kind=kind, extra_args=["a=1", "b"])
    text = manifest(
        f"cfg/{hostile}.yaml",  # the config's path, read in the pod
        2,
        8,
        "img:1",
        "gpt",
        kind=kind,  # type: ignore[arg-type]
        extra_args=[f"recipe.model.name={hostile}", hostile],
    )
    documents, expected = list(yaml.safe_load_all(text)), list(yaml.safe_load_all(plain))
    assert [d["kind"] for d in documents] == [d["kind"] for d in expected]
    assert [_key_paths(d) for d in documents] == [_key_paths(d) for d in expected]
    container = documents[-1]["spec"]
    container = (
        container["pytorchReplicaSpecs"]["Master"]["template"]
        if kind == "pytorchjob"
        else container["replicatedJobs"][0]["template"]["spec"]["template"]
    )["spec"]["containers"][0]
    assert container["command"] == [
        "train", "--config", f"cfg/{hostile}.yaml", "--accelerator", "gpu", "--devices", "8",
        "--resume", "latest", "run.output_dir=/runs", f"recipe.model.name={hostile}", hostile,
    ]  # fmt: skip
    # The header is the same fixed lines, with the hostile path left out of them.
    assert len(_comments(text)) == len(_comments(plain))
    assert text.index("\n---\n") == len("\n".join(_comments(text)))
    assert "<the path the command gives>" in text
    check_manifest(documents)


def test_an_output_dir_given_to_train_k8s_never_reaches_the_pods() -> None:
    """The volume goes at /runs in every pod, and the run writes there: an override of
    run.output_dir (a folder of the machine that wrote the manifest) is left out."""
    hostile = "/mnt/runs # x: y --- kind: Pod"
    text = manifest("run.yaml", 2, 8, "img:1", "gpt", extra_args=[f"run.output_dir={hostile}"])
    _, job = yaml.safe_load_all(text)
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert {"name": "runs", "mountPath": "/runs"} in pod["containers"][0]["volumeMounts"]
    assert hostile not in text and "# The run folder is /runs/gpt/gpt on" in text


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("pvc", f"data\n---\n{POD}\n#", "--pvc"),
        ("pvc", "data\n  readOnly: true", "--pvc"),
        ("pvc", "Team_NFS", "--pvc"),
        ("pvc", "-data", "--pvc"),
        ("pvc", "a" * 254, "--pvc"),
        ("image", f"img:1\n---\n{POD}", "--image"),
        ("image", "img:1\nkind: Pod", "--image"),
        ("image", "img:1 --privileged", "--image"),
        ("image", "img:1\x1b[2J", "--image"),
        ("run_name", f"gpt\n---\n{POD}", "run.name"),
        ("run_name", "../gpt", "run.name"),
    ],
)
def test_what_kubernetes_cannot_take_is_refused_by_its_flag_or_key(
    field: str, value: str, named: str
) -> None:
    given = {"image": "img:1", "run_name": "gpt", "pvc": "data"}
    manifest("run.yaml", 2, 8, **given)  # type: ignore[arg-type]  # the plain values pass
    with pytest.raises(UsageError) as refused:
        manifest("run.yaml", 2, 8, **{**given, field: value})  # type: ignore[arg-type]
    assert refused.value.exit_code == 2
    assert refused.value.message.startswith(f"{named} "), refused.value.message
    assert "\n" not in refused.value.message  # the value is shown escaped, on one line


@pytest.mark.parametrize(
    "pvc", ["data", "team-nfs", "nfs.lab.example", "0data", "a" * 253, "a-b.c-d"]
)
def test_every_name_kubernetes_takes_is_taken(pvc: str) -> None:
    images = ["img", "ghcr.io/lab/train:1", "localhost:5000/a/b:v1.2_rc-3"]
    images += ["nvcr.io/nvidia/pytorch:24.01-py3", "img@sha256:" + "0" * 64, "[::1]:5000/x"]
    for image in images:
        (job,) = yaml.safe_load_all(manifest("run.yaml", 2, 8, image, "gpt", pvc=pvc))
        pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        assert pod["containers"][0]["image"] == image
        assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": pvc}
        check_manifest([job])


@pytest.mark.timeout(60)
def test_train_k8s_refuses_the_issues_injection(tmp_path: Path) -> None:
    """The command of issue 39: a Pod smuggled in through --pvc."""
    pvc = f"data\n---\n{POD}\n#"
    args = ["k8s", "--config", str(REPO / "configs" / "quickstart.yaml"), "--nodes", "2"]
    result = train_in_fork(
        [*args, "--gpus-per-node", "8", "--image", "img:1", "--pvc", pvc], tmp_path
    )
    usage_error(result, "--pvc 'data\\n---", "DNS-1123")
    assert result.stdout == ""


@pytest.mark.timeout(60)
def test_train_k8s_leaves_the_specs_output_dir_out_of_the_manifest(tmp_path: Path) -> None:
    """The spec's output_dir is this machine's: the pods mount the volume at /runs."""
    write_spec(tmp_path / "run.yaml", run={"name": "gpt", "output_dir": f"/runs\n---\n{POD}"})
    args = ["k8s", "--config", "run.yaml", "--nodes", "2", "--gpus-per-node", "8"]
    result = train_in_fork([*args, "--image", "img:1"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Pod" not in result.stdout
    check_manifest(list(yaml.safe_load_all(result.stdout)))


# --- train slurm --------------------------------------------------------------------------


def _script_lines(script: str) -> tuple[list[str], list[str]]:
    """The script's #SBATCH lines, and the argv its srun line runs."""
    lines = script.splitlines()
    directives = [line for line in lines if line.startswith("#SBATCH")]
    (srun,) = [line for line in lines if line.startswith("srun ")]
    assert srun.endswith(" &")
    return directives, shlex.split(srun.removesuffix(" &"))


@pytest.mark.parametrize("hostile", ["a'b", '"$(touch pwned)"', "`touch pwned`; x", "a b #c"])
def test_an_sbatch_script_quotes_every_argument_it_runs(tmp_path: Path, hostile: str) -> None:
    plain = sbatch_script("run.yaml", 2, 8, "gpt", extra_args=["a=1", "b"])
    script = sbatch_script(
        f"cfg/{hostile}.yaml", 2, 8, "gpt", extra_args=[f"run.output_dir={hostile}", hostile]
    )
    directives, argv = _script_lines(script)
    assert directives == _script_lines(plain)[0]
    assert argv == [
        "srun", "--kill-on-bad-exit=1", "train", "--config", f"cfg/{hostile}.yaml",
        "--accelerator", "gpu", "--devices", "8", "--rdzv-id", "$SLURM_JOB_ID", "--resume",
        "latest", f"run.output_dir={hostile}", hostile,
    ]  # fmt: skip
    assert len(script.splitlines()) == len(plain.splitlines())
    # bash reads it as written: a stand-in srun gets exactly those arguments.
    (tmp_path / "srun").write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$FAKE_LOG/argv"\n')
    (tmp_path / "srun").chmod(0o755)
    (tmp_path / "job.sbatch").write_text(script)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "FAKE_LOG": str(tmp_path), "SLURM_JOB_ID": "7"}
    subprocess.run(["bash", "job.sbatch"], cwd=tmp_path, env=env, check=True, timeout=30)
    ran = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert ran == [*argv[1:10], "7", *argv[11:]]
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("hostile", BREAKOUTS[:3] + BREAKOUTS[5:] + ["a\tb", "a\x1b[2Jb"])
@pytest.mark.parametrize("where", ["--config", "override", "run.name"])
def test_a_value_that_cannot_stay_on_its_line_is_refused(where: str, hostile: str) -> None:
    config, name, extra = "run.yaml", "gpt", ["a=1"]
    if where == "--config":
        config = f"cfg/{hostile}.yaml"
    elif where == "override":
        extra = [f"recipe.source={hostile}"]
    else:
        name = hostile
    with pytest.raises(UsageError) as refused:
        sbatch_script(config, 2, 8, name, extra_args=extra)
    assert refused.value.message.startswith(f"{where} "), refused.value.message
    assert "\n" not in refused.value.message


@pytest.mark.timeout(60)
def test_train_slurm_refuses_an_override_across_lines(tmp_path: Path) -> None:
    """An override whose YAML value spans lines is valid YAML, and the spec takes it; the
    script's command line cannot hold it."""
    spec = write_spec(tmp_path / "run.yaml", run={"name": "gpt", "output_dir": "runs"})
    args = ["slurm", "--config", str(spec), "--nodes", "2", "--gpus-per-node", "1"]
    result = train_in_fork([*args, "run.output_dir=runs\n#SBATCH --requeue=no"], tmp_path)
    usage_error(result, "override 'run.output_dir=runs\\n#SBATCH", "batch script")
    assert result.stdout == ""

"""Metadata that a damaged or hostile folder holds is read bounded (issue 39): a checkpoint's
meta.json, a Hugging Face index or a safetensors header that is a link to /dev/zero, a 3 GiB
sparse file or JSON nested 100,000 levels deep is refused before anything starts, with exit 2
and one line naming the file. A safetensors header is checked whole as the format requires,
and the names a file gives its tensors reach the terminal with their escape codes escaped.

No run is needed: checkpoints are written by DCP in this process. `train` runs under a 1 GiB
data limit, so that a read that is no longer bounded fails with a MemoryError here instead of
exhausting the machine."""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from launcher.checkpoint.format import damage
from launcher.checkpoint.safetensors_header import NotSafetensors, tensor_shapes
from launcher.checkpoint.weights import _refusal, match_names
from launcher.checkpoint.weights_source import WeightsSource
from launcher.rundir.layout import CheckpointFiles
from launcher.rundir.reading import UnreadableJson, read_json
from tests.conftest import usage_error, write_spec
from tests.forked_train import train_in_fork

pytestmark = [
    pytest.mark.launcher_only,
    pytest.mark.timeout(120),
    # DCP in this process, on purpose: the checkpoints.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:TypedStorage is deprecated"),  # torch 2.9 DCP saves
]

RUN = "runs/t/a"
CHECKPOINT = f"{RUN}/checkpoints/step-00000002"
DEEP = "[" * 100_000 + "]" * 100_000


def _sparse(path: Path) -> None:
    with open(path, "wb") as file:
        file.truncate(3 << 30)  # 3 GiB of holes: no disk used


# What a JSON file is made, and what the refusal says of it.
BAD_JSON: dict[str, tuple[Callable[[Path], None], str]] = {
    "dev-zero": (lambda path: path.symlink_to("/dev/zero"), "not a regular file"),
    "huge": (_sparse, "3,221,225,472 bytes, more than a"),
    "deep": (lambda path: path.write_text(DEEP), "nested too deeply"),
}


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (2**30, 2**30))


def _train(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # A fork of the warm test server (`tests.forked_train`): the limit is set in the fork.
    return train_in_fork(args, cwd, timeout=90, preexec_fn=_limit_memory)


def _refused(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    """Exit 2, no traceback, and one error line that says every expected text."""
    usage_error(result)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error" in line]
    assert len(errors) == 1, result.stdout + result.stderr
    for text in expected:
        assert text in errors[0], errors[0]


def _checkpoint(folder: Path) -> Path:
    """A run folder's checkpoint, whole but for what a test does to its meta.json."""
    checkpoint = folder / CHECKPOINT
    dcp.save({"model": {"w": torch.ones(3)}}, checkpoint_id=checkpoint, no_dist=True)
    CheckpointFiles(checkpoint).marker.write_text("")
    write_spec(folder / "run.yaml")  # run.name t, under folder/runs
    return checkpoint


# Every way the launcher reads a checkpoint's meta.json from the command line.
META_READERS = {
    "resume-path": ["--resume", CHECKPOINT],
    "resume-path-with-config": ["--config", "run.yaml", "--resume", CHECKPOINT],
    "resume-best": ["--config", "run.yaml", "--resume", "best"],
    "load-weights": ["--config", "run.yaml", "--load-weights", RUN],
    "export-best": ["export", RUN, "--best", "--out", "model.pt"],
}


# /dev/zero and deep nesting through each reader; a huge file takes the same check as /dev/zero.
META_CASES = [
    *((r, b) for b in ("dev-zero", "deep") for r in META_READERS),
    ("resume-best", "huge"),
]


@pytest.mark.parametrize(("reader", "bad"), META_CASES)
def test_a_meta_json_that_cannot_be_read_whole_is_refused_in_one_line(
    tmp_path: Path, reader: str, bad: str
) -> None:
    make, said = BAD_JSON[bad]
    make(CheckpointFiles(_checkpoint(tmp_path)).meta)
    _refused(_train(META_READERS[reader], tmp_path), "step-00000002", "meta.json", said)
    assert not (tmp_path / "model.pt").exists()
    assert [p.name for p in (tmp_path / "runs" / "t").iterdir()] == ["a"]  # no run folder


@pytest.mark.parametrize("reader", ["resume-path", "resume-path-with-config"])
def test_a_meta_json_that_records_no_spec_is_refused_in_one_line(
    tmp_path: Path, reader: str
) -> None:
    """Valid JSON, whole, but without the spec a resume starts from: a KeyError before."""
    files = CheckpointFiles(_checkpoint(tmp_path))
    torch.save({}, files.rank_state(0))  # whole, for the damage check before the spec is read
    files.meta.write_text(json.dumps({"world_size": 1, "step": 2, "spec": ["not", "a", "spec"]}))
    _refused(_train(META_READERS[reader], tmp_path), "meta.json", "records no spec")


# A Hugging Face folder's index, or the one safetensors file it holds.
@pytest.mark.parametrize("bad", BAD_JSON)
def test_a_hugging_face_index_that_cannot_be_read_whole_is_refused(
    tmp_path: Path, bad: str
) -> None:
    make, said = BAD_JSON[bad]
    (tmp_path / "hf").mkdir()
    make(tmp_path / "hf" / "model.safetensors.index.json")
    write_spec(tmp_path / "run.yaml")
    result = _train(["--config", "run.yaml", "--load-weights", "hf"], tmp_path)
    _refused(result, "load.weights", "model.safetensors.index.json", said)
    assert not (tmp_path / "runs").exists()


def _safetensors(path: Path, header: dict | str, data: int) -> Path:
    """A safetensors file: its header as given, then `data` bytes."""
    text = header if isinstance(header, str) else json.dumps(header)
    path.write_bytes(struct.pack("<Q", len(text)) + text.encode() + b"\0" * data)
    return path


def test_a_safetensors_header_nested_too_deeply_or_a_device_is_refused(tmp_path: Path) -> None:
    write_spec(tmp_path / "run.yaml")
    deep = _safetensors(tmp_path / "deep.safetensors", DEEP, 0)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").symlink_to("/dev/zero")
    cases = {
        str(deep): (str(deep), "its header is nested too deeply"),
        "hf": ("hf/model.safetensors", "not a regular file"),
    }
    for given, (named, said) in cases.items():
        result = _train(["--config", "run.yaml", "--load-weights", given], tmp_path)
        _refused(result, "load.weights", named, said)
    assert not (tmp_path / "runs").exists()


def _tensor(shape: list[int], begin: int, end: int, dtype: str = "F32") -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# (header, bytes of data, what the refusal says): each as safetensors' own reader refuses it.
BAD_HEADERS = {
    "overlapping": (
        {"a": _tensor([4], 0, 16), "b": _tensor([4], 8, 24)},
        24,
        "tensor 'b' overlaps tensor 'a'",
    ),
    "reversed": (
        {"a": _tensor([0], 16, 0)},
        16,
        "tensor 'a': its data_offsets [16, 0] are reversed",
    ),
    "negative": ({"a": _tensor([4], -16, 0)}, 16, "tensor 'a': data_offsets must be [begin, end]"),
    "short": (
        {"a": _tensor([4], 0, 8)},
        8,
        "shape [4] of F32 is 16 bytes, its data_offsets [0, 8]",
    ),
    "gap": (
        {"a": _tensor([2], 0, 8), "b": _tensor([2], 16, 24)},
        24,
        "no tensor holds bytes 8 to 16 (before tensor 'b')",
    ),
    "not-from-0": ({"a": _tensor([2], 8, 16)}, 16, "no tensor holds bytes 0 to 8"),
    "past-the-end": ({"a": _tensor([4], 0, 16)}, 8, "truncated: its header places 16 bytes"),
    "bytes-left-over": ({"a": _tensor([2], 0, 8)}, 16, "8 bytes after its last tensor"),
    "unknown-dtype": ({"a": _tensor([2], 0, 8, "F33")}, 8, "tensor 'a': unknown dtype 'F33'"),
    "dtype-not-text": ({"a": _tensor([2], 0, 8, ["F32"])}, 8, "unknown dtype ['F32']"),
    "shape-of-floats": ({"a": _tensor([2.0], 0, 8)}, 8, "tensor 'a': no shape"),
    "huge-shape": ({"a": _tensor([2**40] * 4, 0, 8)}, 8, "more than 2**64 bytes"),
    "metadata-not-text": ({"__metadata__": {"k": 1}}, 0, "__metadata__ is not a map of strings"),
    "not-an-object": ("[1, 2]", 0, "its header is not a JSON object"),
}


@pytest.mark.parametrize("case", BAD_HEADERS)
def test_a_safetensors_header_is_checked_whole(tmp_path: Path, case: str) -> None:
    header, data, said = BAD_HEADERS[case]
    with pytest.raises(NotSafetensors) as refused:
        tensor_shapes(_safetensors(tmp_path / "w.safetensors", header, data))
    assert said in str(refused.value)


def test_a_whole_safetensors_file_passes_the_check(tmp_path: Path) -> None:
    """As safetensors writes them: any order of entries, empty tensors, metadata, padding."""
    from safetensors.torch import save_file

    tensors = {"b": torch.ones(2, 3), "a": torch.zeros(5, dtype=torch.int8), "e": torch.ones(0)}
    save_file(tensors, str(tmp_path / "w.safetensors"), metadata={"format": "pt"})
    shapes = tensor_shapes(tmp_path / "w.safetensors")
    assert shapes == {"b": [2, 3], "a": [5], "e": [0]}
    header = {"z": _tensor([2], 0, 8), "__metadata__": {"k": "v"}, "y": _tensor([0], 8, 8)}
    assert tensor_shapes(_safetensors(tmp_path / "mine.safetensors", header, 8)) == {
        "z": [2],
        "y": [0],
    }


def test_bad_offsets_are_refused_before_a_run_folder_exists(tmp_path: Path) -> None:
    """Through the flag, the key, and `train validate`."""
    header = {"a": _tensor([4], 0, 16), "b": _tensor([4], 8, 24)}
    _safetensors(tmp_path / "w.safetensors", header, 24)
    write_spec(tmp_path / "run.yaml")
    given = (["--load-weights", "w.safetensors"], ["load.weights=w.safetensors"])
    for args in ([*given[0]], [*given[1]], ["validate", *given[1]]):
        result = _train([*args, "--config", "run.yaml"], tmp_path)
        _refused(result, "load.weights", "w.safetensors", "tensor 'b' overlaps tensor 'a'")
    assert not (tmp_path / "runs").exists()


ESCAPE = "\x1b]0;pwned\x07\x1b[2J"


def test_tensor_names_reach_the_terminal_with_escape_codes_escaped(tmp_path: Path) -> None:
    """A weights file's names: in the header's check, and in the refusal a rank prints (which
    the failure panel shows as the rank's log holds it)."""
    header = {f"{ESCAPE}w": _tensor([4], 0, 8)}
    with pytest.raises(NotSafetensors) as refused:
        tensor_shapes(_safetensors(tmp_path / "w.safetensors", header, 8))
    assert "\x1b" not in str(refused.value) and "\\x1b]0;pwned" in str(refused.value)
    match = match_names({f"{ESCAPE}w": (4,)}, {"w": (4,)}, noun="weights")
    said = _refusal(WeightsSource(tmp_path, "safetensors"), match.problems).render()
    assert "\x1b" not in said and "\x07" not in said
    assert "not in the run: \\x1b]0;pwned\\x07\\x1b[2Jw" in said


def test_read_json_takes_only_a_regular_file_within_its_kind_s_limit(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")  # opened for reading, it would wait for a writer
    (tmp_path / "folder").mkdir()
    made = {"fifo": "not a regular file", "folder": "not a regular file"}
    for bad, (make, said) in BAD_JSON.items():
        make(tmp_path / bad)
        made[bad] = said
    for name, said in made.items():
        with pytest.raises(UnreadableJson, match=said):
            read_json(tmp_path / name, "checkpoint meta")
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "nothing", "checkpoint meta")


def test_the_damage_check_opens_no_fifo_and_survives_a_forged_length(tmp_path: Path) -> None:
    """A FIFO in a checkpoint would block the launcher's check forever; a pickle length of
    2**62 bytes would make the unpickler allocate it before it finds the file far shorter."""
    checkpoint = _checkpoint(tmp_path)
    files = CheckpointFiles(checkpoint)
    files.meta.write_text(json.dumps({"world_size": 1}))
    os.mkfifo(files.rank_state(0))
    assert damage(checkpoint) == "rank-0.pt is not a regular file"
    files.dcp_metadata.rename(tmp_path / "metadata")
    os.mkfifo(files.dcp_metadata)
    assert (
        damage(checkpoint)
        == ".metadata: corrupt or unsafe checkpoint metadata (.metadata is not a regular file)"
    )
    files.dcp_metadata.unlink()
    # Protocol 4, then BINBYTES8 of 2**62 bytes, of which the file holds 4.
    files.dcp_metadata.write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", 2**62) + b"abcd")
    assert "it claims more memory than there is" in (damage(checkpoint) or "")

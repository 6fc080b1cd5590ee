"""The Checkpointer's own contract, in one real gloo process: publication is atomic, pruning
waits for completeness, and a background save holds the state as it was when saved."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from launcher.checkpoint import checkpointer as checkpoint
from launcher.checkpoint.store import store_at
from launcher.parallel.ddp import DDPStrategy
from launcher.rundir.layout import CheckpointFiles, RunLayout


class Held:
    """State the checkpointer is handed: fixed tensors to save (DCP), and a world size."""

    def __init__(self, state: dict, model: torch.nn.Module | None = None) -> None:
        self.state, self.model = state, model

    def state_dict(self) -> dict:
        return self.state

    def rank_state_dict(self) -> dict:
        return {"rng": torch.get_rng_state()}

    def load_state_dict(self, *loaded: object) -> None:  # the model's, or the loop's
        pass


def _saver(strategy, run_dir: Path, state: dict, model=None, **options):  # type: ignore[no-untyped-def]
    return checkpoint.Checkpointer(
        strategy, run_dir, Held(state, model), Held({"world_size": 1}), **options
    )


@pytest.fixture
def strategy(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    ).items():
        monkeypatch.setenv(key, value)
    strategy = DDPStrategy("cpu", "fp32")
    strategy.setup()
    yield strategy
    strategy.teardown()


def _load(path: Path, like: torch.Tensor, strategy: DDPStrategy) -> torch.Tensor:
    state = {"model": {"w": torch.empty_like(like)}}
    checkpoint.load(path, state, strategy)
    return state["model"]["w"]


@pytest.mark.timeout(120)
def test_background_save_holds_the_state_as_it_was(tmp_path: Path, strategy) -> None:
    weights = torch.zeros(64 * 1024 * 1024 // 4)  # 64 MB: copying it takes a while
    model = torch.nn.Module()  # weights are a parameter: the save must not copy them up front
    model.w = torch.nn.Parameter(weights, requires_grad=False)
    saver = _saver(strategy, tmp_path, {"model": {"w": weights}}, model, use_async=True)
    saver.save(1)
    saver.before_update()  # what the loop does before the optimizer changes the weights
    weights.add_(1.0)
    saver.close()
    saved = _load(RunLayout(tmp_path).checkpoint(1), weights, strategy)
    assert torch.count_nonzero(saved) == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("use_async", [False, True])
def test_publish_and_prune_only_complete_checkpoints(tmp_path: Path, strategy, use_async) -> None:
    state: dict = {"model": {}}
    saver = _saver(strategy, tmp_path, state, keep_last=2, use_async=use_async)
    for step in (1, 2, 3):
        state["model"] = {"w": torch.full((4,), float(step))}
        saver.save(step)
        saver.before_update()
    saver.close()
    names = [p.name for p in store_at(RunLayout(tmp_path).checkpoints).complete()]
    assert names == ["step-00000002", "step-00000003"]
    assert not list((tmp_path / "checkpoints").glob(".*partial"))
    assert (
        _load(tmp_path / "checkpoints" / "step-00000003", torch.zeros(4), strategy).tolist()
        == [3.0] * 4
    )


@pytest.mark.timeout(120)
def test_a_save_records_the_random_state_of_the_step_it_saves(
    tmp_path: Path, strategy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On XLA every barrier cuts the graph, which advances the random seed: what a rank saves
    is its state when the save was asked for, not after the save's own barriers."""
    barrier = strategy.barrier

    def drawing_barrier() -> None:
        torch.rand(1)
        barrier()

    monkeypatch.setattr(strategy, "barrier", drawing_barrier)
    before = torch.get_rng_state()
    saver = _saver(strategy, tmp_path, {"model": {"w": torch.zeros(4)}})
    saver.save(1)
    saver.close()
    saved = torch.load(
        CheckpointFiles(RunLayout(tmp_path).checkpoint(1)).rank_state(0), weights_only=True
    )
    assert torch.equal(saved["rng"], before)


def test_metadata_cannot_reach_through_an_allowed_module(tmp_path: Path) -> None:
    """Pickle protocol 4 resolves dotted names: filesystem.os.getcwd would run os.getcwd."""
    import pickle

    from launcher.checkpoint.format import read_metadata
    from launcher.errors import UsageError

    def text(s: bytes) -> bytes:
        return pickle.SHORT_BINUNICODE + bytes([len(s)]) + s

    payload = (
        b"\x80\x04"
        + text(b"torch.distributed.checkpoint.filesystem")
        + text(b"os.getcwd")
        + pickle.STACK_GLOBAL
        + pickle.EMPTY_TUPLE
        + pickle.REDUCE
        + pickle.STOP
    )
    assert isinstance(pickle.loads(payload), str)  # plain pickle would run it
    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(UsageError, match="corrupt or unsafe checkpoint metadata"):
        read_metadata(tmp_path)


def _staged_buffers(saver) -> dict[int, int]:  # type: ignore[no-untyped-def]
    """The host copies the background stager keeps for the next save: source storage -> copy's
    address (torch's StateDictStager's own cache; empty where it drops them)."""
    cache = saver._stager._state_dict_stager._cached_storage_mapping
    return {id(source): copy.data_ptr() for source, copy in cache.items()}


@pytest.mark.smoke  # torch 2.11's DefaultStager dropped its buffers after every staging
@pytest.mark.timeout(120)
def test_background_saves_stage_into_the_same_buffers(tmp_path: Path, strategy) -> None:
    weights = torch.randn(1024 * 1024)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(weights, requires_grad=False)
    saver = _saver(strategy, tmp_path, {"model": {"w": weights}}, model, use_async=True)
    if saver._stager is None:
        pytest.skip("this torch has no background stager")
    kept = []
    for step in (1, 2):
        saver.save(step)
        saver.wait()
        kept.append(_staged_buffers(saver))
    saver.close()
    assert kept[0], "the stager kept no copy of the weights for the next save"
    assert kept[1] == kept[0]  # the second save copied into the first one's buffers
    saved = _load(RunLayout(tmp_path).checkpoint(2), weights, strategy)
    assert torch.equal(saved, weights)


@pytest.mark.timeout(120)
def test_a_save_that_waits_for_the_last_ones_write_says_so(
    tmp_path: Path, strategy, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = torch.zeros(256 * 1024 * 1024 // 4)  # 256 MB: its write outlasts the next call
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(weights, requires_grad=False)
    saver = _saver(strategy, tmp_path, {"model": {"w": weights}}, model, use_async=True)
    saver.save(1)
    saver.save(2)  # at once: the first save is still writing
    saver.save(3)
    saver.close()
    out = capsys.readouterr().out
    assert out.count("WARNING") == 1  # once a run
    assert "the save at step 2 waited" in out and "for the one at step 1" in out
    assert "checkpoint.every_n_steps" in out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("use_async", [False, True])
def test_a_store_publishes_by_marker_and_prunes_it_first(
    tmp_path: Path, strategy, use_async
) -> None:
    """The object store's rules, through fsspec's own local file system (`file://`): no rename,
    the marker last; a half-written folder is never taken, and the next attempt clears it as
    it starts; the checkpoint an attempt resumed from is never pruned."""
    from launcher.checkpoint.store import record_store
    from launcher.storage_url import location

    root = location(f"file://{tmp_path}/store")
    (tmp_path / "run").mkdir()
    record_store(tmp_path / "run", root)
    state: dict = {"model": {"w": torch.zeros(4)}}
    saver = _saver(strategy, tmp_path / "run", state, keep_last=1, use_async=use_async)
    saver.save(1)
    saver.close()
    half = tmp_path / "store" / "step-00000002"
    half.mkdir()
    (half / "__1_0.distcp").write_bytes(b"an upload cut short")  # no COMPLETE: not taken
    assert [p.name for p in saver.store.complete()] == ["step-00000001"]
    saver = _saver(strategy, tmp_path / "run", state, keep_last=1, use_async=use_async)
    assert not half.exists()  # the next attempt cleared it as it started
    assert saver.load(saver.store.checkpoint(1))  # resumed from step 1: never pruned
    for step in (2, 3):
        state["model"] = {"w": torch.full((4,), float(step))}
        saver.save(step)
        saver.before_update()
    saver.close()
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == [
        "step-00000001",
        "step-00000003",
    ]
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert _load(saver.store.checkpoint(3), torch.zeros(4), strategy).tolist() == [3.0] * 4

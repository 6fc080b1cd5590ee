"""What a healing replica group receives from a live one (`fault_tolerance`), and how it
travels: torchft's `CheckpointTransport`, served over HTTP by each group and fetched by a
group that restarted.

torchft's own transport listens on every interface, answers anyone, and loads what it
receives with full pickle (`weights_only=False`): whoever reaches the port downloads the
run's weights, and whoever poses as a peer runs code in the healing group. This one:

- listens on the address the run gives it (loopback on one machine, the rendezvous
  network's interface across machines), never on every interface;
- answers only a request that carries the run's token (`ReplicaGroup.token`, in the worker
  plan, which only the run's user can read), and says nothing else to anyone;
- sends tensors and plain values only (a sharded parameter as its local shard, with its
  placements as plain data), and loads with torch's restricted unpickler
  (`weights_only=True`): nothing that arrives can run code.
"""

from __future__ import annotations

import hmac
import socket
import threading
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from torch.distributed._serialization import _streaming_load, _streaming_save
from torchft.checkpointing.transport import CheckpointTransport

from launcher.parallel.base import map_tensors

_TOKEN_HEADER = "X-Launcher-Run-Token"
_SHARD = "__local_shard__"  # marks a DTensor in transit: its local shard and how to rebuild it


class PeerStateServer(CheckpointTransport[dict[str, Any]]):
    """Serves this group's state to a healing group at `http://HOST:PORT/checkpoint/STEP`,
    and fetches a live group's the same way."""

    def __init__(self, listen: str, advertise: str, token: str, timeout: timedelta) -> None:
        self._token, self._timeout = token, timeout.total_seconds()
        self._state: dict[str, Any] | None = None
        self._step = -1
        self._open = False  # serving `_step`'s state (between send_checkpoint and disallow)
        self._readers = 0  # requests being answered
        self._changed = threading.Condition()
        self._server = _Server((listen, 0), _handler(self))
        self._advertise = advertise
        # Polled every 0.1 s for a shutdown: a worker's exit waits for it (0.5 s by default).
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.1,), name="peer-state-server", daemon=True
        )
        self._thread.start()

    # -- the sending side --------------------------------------------------------------------

    def metadata(self) -> str:
        host = f"[{self._advertise}]" if ":" in self._advertise else self._advertise
        return f"http://{host}:{self._server.server_address[1]}/checkpoint/"

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: dict[str, Any], timeout: timedelta
    ) -> None:
        # Off the accelerator before serving: the step goes on with the device's copy.
        state = map_tensors(state_dict, lambda t: t if t.device.type == "cpu" else t.cpu())
        with self._changed:
            self._state, self._step, self._open = state, step, True
            self._changed.notify_all()

    def disallow_checkpoint(self) -> None:
        """Once the requests under way are answered: the state may change from here on."""
        with self._changed:
            self._open = False
            self._changed.wait_for(lambda: self._readers == 0, timeout=self._timeout)
            self._state = None

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()

    def answer(self, request: BaseHTTPRequestHandler) -> None:
        """One request: the state of the step asked for, to the run's groups only."""
        given = request.headers.get(_TOKEN_HEADER, "")
        if not hmac.compare_digest(given.encode(), self._token.encode()):
            request.send_error(403)
            return
        step = _step_asked(request.path)
        with self._changed:
            if not self._changed.wait_for(lambda: self._open, timeout=self._timeout):
                request.send_error(503, "no state is being served")
                return
            if step != self._step:
                request.send_error(404, f"serving step {self._step}, not {step}")
                return
            self._readers += 1
            state = self._state
        try:
            request.send_response(200)
            request.send_header("Content-Type", "application/octet-stream")
            request.end_headers()
            _streaming_save(state, request.wfile)
        finally:
            with self._changed:
                self._readers -= 1
                self._changed.notify_all()

    # -- the receiving side ------------------------------------------------------------------

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta
    ) -> dict[str, Any]:
        if not metadata.startswith("http://") or not metadata.endswith("/checkpoint/"):
            raise ValueError(f"a live group named no state server of this run ({metadata!r})")
        request = urllib.request.Request(f"{metadata}{step}", headers={_TOKEN_HEADER: self._token})
        with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as response:
            # Tensors and plain values only: torch's restricted unpickler builds nothing else.
            state = _streaming_load(response, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"a live group sent no state ({type(state).__name__})")
        return state


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)


def _handler(server: PeerStateServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = server._timeout  # a request that stalls does not hold a thread forever

        def do_GET(self) -> None:
            server.answer(self)

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: every request would be a line in the rank's log."""

    return Handler


def _step_asked(path: str) -> int | None:
    parts = path.strip("/").split("/")
    if len(parts) == 2 and parts[0] == "checkpoint" and parts[1].isdigit():
        return int(parts[1])
    return None


# -- a sharded state, as tensors and plain values -----------------------------------------


def packed(tree: Any) -> Any:
    """`tree` with every DTensor as its local shard and its layout as plain data: a device
    mesh does not travel, and the receiver's restricted unpickler builds no placement."""
    from torch.distributed.tensor import DTensor

    def pack(tensor: torch.Tensor) -> Any:
        if not isinstance(tensor, DTensor):
            return tensor
        return {
            _SHARD: tensor.to_local(),
            "placements": [_placement_data(p) for p in tensor.placements],
            "shape": list(tensor.shape),
            "stride": list(tensor.stride()),
        }

    return map_tensors(tree, pack)


def unpacked(tree: Any, mesh: Any) -> Any:
    """`packed`'s tree with every shard a DTensor again, on `mesh` (the receiver's own: the
    groups lay out their meshes alike)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict) and _SHARD in tree:
        return DTensor.from_local(
            tree[_SHARD].to(mesh.device_type),
            mesh,
            [_placement(data) for data in tree["placements"]],
            run_check=False,
            shape=torch.Size(tree["shape"]),
            stride=tuple(tree["stride"]),
        )
    if isinstance(tree, dict):
        return {k: unpacked(v, mesh) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(unpacked(v, mesh) for v in tree)
    return tree


def _placement_data(placement: Any) -> dict[str, Any]:
    fields = ("dim", "split_factor", "reduce_op")
    data = {name: getattr(placement, name) for name in fields if hasattr(placement, name)}
    return {"kind": type(placement).__name__, **data}


def _placement(data: dict[str, Any]) -> Any:
    """A placement rebuilt from `_placement_data`: only the kinds named here are built."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    kinds = {"Shard": Shard, "Replicate": Replicate, "Partial": Partial}
    kinds["_StridedShard"] = _StridedShard
    fields = {k: v for k, v in data.items() if k != "kind"}
    return kinds[data["kind"]](**fields)

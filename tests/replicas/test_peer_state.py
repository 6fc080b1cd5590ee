"""What a healing replica group receives (`launcher.replicas.peer_state`): the run's groups
alone are answered, and what arrives is loaded as tensors and plain values, never as code."""

from __future__ import annotations

import io
import pickle
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")

from launcher.replicas.peer_state import PeerStateServer

TIMEOUT = timedelta(seconds=10)


def test_a_groups_state_goes_to_a_group_with_the_token_and_no_one_else() -> None:
    sender = PeerStateServer("127.0.0.1", "127.0.0.1", "secret", TIMEOUT)
    receiver = PeerStateServer("127.0.0.1", "127.0.0.1", "secret", TIMEOUT)
    stranger = PeerStateServer("127.0.0.1", "127.0.0.1", "guess", TIMEOUT)
    try:
        state = {"model": {"w": torch.arange(6.0).view(2, 3)}, "loop": {"step": 7, "lr": [0.1]}}
        sender.send_checkpoint([1], 7, state, TIMEOUT)
        got = receiver.recv_checkpoint(0, sender.metadata(), 7, TIMEOUT)
        torch.testing.assert_close(got["model"]["w"], state["model"]["w"])
        assert got["loop"] == {"step": 7, "lr": [0.1]}
        with pytest.raises(Exception, match="403"):
            stranger.recv_checkpoint(0, sender.metadata(), 7, TIMEOUT)
        with pytest.raises(Exception, match="404"):  # another step than the one served
            receiver.recv_checkpoint(0, sender.metadata(), 8, TIMEOUT)
        sender.disallow_checkpoint()
    finally:
        for server in (sender, receiver, stranger):
            server.shutdown()


class _Payload:
    def __reduce__(self) -> tuple:
        return (Path.touch, (Path(self.marker),))  # type: ignore[attr-defined]


def test_a_peer_that_sends_code_is_refused_and_its_code_never_runs(tmp_path: Path) -> None:
    """A state server posing as a peer answers with a pickle that would create a file."""
    from torch.distributed._serialization import _streaming_save

    marker = tmp_path / "ran"
    payload = _Payload()
    payload.marker = str(marker)  # type: ignore[attr-defined]
    body = io.BytesIO()
    _streaming_save({"model": payload}, body)

    class Posing(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.getvalue())

        def log_message(self, *args: object) -> None:
            pass

    posing = HTTPServer(("127.0.0.1", 0), Posing)
    threading.Thread(target=posing.serve_forever, daemon=True).start()
    receiver = PeerStateServer("127.0.0.1", "127.0.0.1", "secret", TIMEOUT)
    try:
        url = f"http://127.0.0.1:{posing.server_address[1]}/checkpoint/"
        with pytest.raises(pickle.UnpicklingError):
            receiver.recv_checkpoint(0, url, 3, TIMEOUT)
        assert not marker.exists()
    finally:
        receiver.shutdown()
        posing.shutdown()

"""A real S3 endpoint on loopback for the tests: moto's server (the pattern s3fs's own tests
use), in a thread of the test process; `train` subprocesses reach it over HTTP, with their
credentials and endpoint in the environment as a user's would be.

`slow_puts` holds back chosen uploads (a path's ending → seconds), so that a test can kill a
run in the middle of a save, with some files of a checkpoint in the store and not others (an
upload the test lets go of before its time, by removing its entry, is refused, not written);
`refused_puts` answers chosen uploads with S3's AccessDenied, which no client retries;
`truncated_gets` answers downloads of chosen objects (a path's ending) with half their bytes
under the whole one's Content-Length, as a connection cut mid-body does; `failing_paths` answers
every request whose path or query holds one of its texts (a listing names its prefix in the
query) with HTTP 500, which clients retry, then give up on. `requests` logs every request as
`METHOD /path?query`, in the order they came (a listing is `GET /bucket?list-type=2...`)."""

from __future__ import annotations

import logging
import secrets
import time
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

import pytest

from tests.conftest import free_port

moto_server = pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

BUCKET = "runs"
_ACCESS_DENIED = (
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code>"
    b"<Message>refused by the test</Message></Error>"
)
_INTERNAL_ERROR = (
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
    b"<Message>failed by the test</Message></Error>"
)


class S3Server(moto_server.ThreadedMotoServer):
    def __init__(self) -> None:
        super().__init__(ip_address="127.0.0.1", port=free_port(), verbose=False)
        self.slow_puts: dict[str, float] = {}
        self.refused_puts: set[str] = set()
        self.truncated_gets: set[str] = set()
        self.failing_paths: set[str] = set()
        self.requests: list[str] = []
        # Unique per server: a test greps a run's files for them.
        self.env = {
            "AWS_ACCESS_KEY_ID": f"key-{secrets.token_hex(6)}",
            "AWS_SECRET_ACCESS_KEY": f"secret-{secrets.token_hex(12)}",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self._port}",
            # No credentials of this machine's user may stand in for missing ones.
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
            "AWS_CONFIG_FILE": "/nonexistent",
        }

    def _server_entry(self) -> None:
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server(
            self._ip_address, self._port, self._held_back(app), threaded=True
        )
        self._server_ready_event.set()
        self._server.serve_forever()

    def _held_back(self, app: Any) -> Any:
        def held(environ: dict[str, Any], start_response: Any) -> Any:
            path, method = environ.get("PATH_INFO", ""), environ["REQUEST_METHOD"]
            query = unquote(environ.get("QUERY_STRING", ""))
            self.requests.append(f"{method} {path}?{query}")
            if any(text in f"{path}?{query}" for text in self.failing_paths):
                start_response("500 Internal Server Error", [("Content-Type", "application/xml")])
                return [] if method == "HEAD" else [_INTERNAL_ERROR]
            if method == "GET" and any(path.endswith(end) for end in self.truncated_gets):
                return _truncated(app, environ, start_response)
            if method == "PUT" and not self._held_for_their_time(path):
                start_response("503 Service Unavailable", [("Content-Type", "application/xml")])
                return [_INTERNAL_ERROR]
            if method == "PUT" and any(path.endswith(end) for end in self.refused_puts):
                start_response("403 Forbidden", [("Content-Type", "application/xml")])
                return [_ACCESS_DENIED]
            return app(environ, start_response)

        return held

    def _held_for_their_time(self, path: str) -> bool:
        """Holds an upload `slow_puts` names for its seconds; False where the test let it go
        first (removed its entry): the upload is then refused, never written late, as the
        client that sent it may be gone and a run since may have written the same file."""
        for ending, seconds in list(self.slow_puts.items()):
            if path.endswith(ending):
                until = time.monotonic() + seconds
                while time.monotonic() < until:
                    if ending not in self.slow_puts:
                        return False
                    time.sleep(0.05)
        return True

    def filesystem(self) -> Any:
        return s3fs.S3FileSystem(
            key=self.env["AWS_ACCESS_KEY_ID"],
            secret=self.env["AWS_SECRET_ACCESS_KEY"],
            endpoint_url=self.env["AWS_ENDPOINT_URL"],
            use_listings_cache=False,
        )


def _truncated(app: Any, environ: dict[str, Any], start_response: Any) -> Any:
    """The app's answer with its headers as they are (Content-Length the whole body's) and
    the first half of its body: werkzeug's server then closes the connection, mid-body."""
    answer: list[Any] = []
    body = b"".join(app(environ, lambda status, headers, *_: answer.extend([status, headers])))
    start_response(*answer)
    return [body[: len(body) // 2]]


def s3_server() -> Iterator[S3Server]:
    """A started server with one bucket, `runs`; stopped after."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = S3Server()
    server.start()
    try:
        # moto keeps its buckets in this process, not in a server: start from none, whatever
        # another test module's server left.
        reset = f"{server.env['AWS_ENDPOINT_URL']}/moto-api/reset"
        urllib.request.urlopen(urllib.request.Request(reset, method="POST"), timeout=30).close()
        server.filesystem().mkdir(BUCKET)
        yield server
    finally:
        server.stop()

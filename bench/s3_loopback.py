"""moto's S3 server on loopback for the benchmarks that save to a store: a bucket `bench`,
and the environment that reaches it (its endpoint and throwaway credentials)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator


@contextlib.contextmanager
def s3_on_loopback(wanted: bool = True) -> Iterator[dict[str, str] | None]:
    """The environment (this process's, plus the store's) while the server runs; None where
    not `wanted`."""
    if not wanted:
        yield None
        return
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
    env |= {"AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    client = boto3.client(
        "s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="bench",
        aws_secret_access_key="bench", region_name="us-east-1",
    )  # fmt: skip
    client.create_bucket(Bucket="bench")
    try:
        yield env
    finally:
        server.stop()

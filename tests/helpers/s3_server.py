"""A real S3 HTTP endpoint on 127.0.0.1 for tests: moto's `ThreadedMotoServer`.

dvc, dvc-s3 and boto3 talk to it over HTTP exactly as they talk to AWS; nothing is mocked in
the client. moto keeps its buckets in process memory, so stopping the server and starting it
again on the same port keeps the objects (an endpoint that went away and came back).
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from moto.server import ThreadedMotoServer

# Fake credentials: moto accepts any; they let tests check that secrets never leak.
ACCESS_KEY_ID = "AKIAFAKEDRAFTLINE0001"
SECRET_ACCESS_KEY = "fake-secret-draftline-Zq8xW2pL"
REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """Start, stop and restart a moto S3 server on a fixed local port."""

    def __init__(self) -> None:
        self.port = _free_port()
        self._server: ThreadedMotoServer | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        """Stop serving and close the listening socket, so clients get 'connection refused'."""
        if self._server is None:
            return
        server = self._server
        self._server = None
        server.stop()
        inner = getattr(server, "_server", None)
        if inner is not None:
            inner.server_close()

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY_ID,
            aws_secret_access_key=SECRET_ACCESS_KEY,
            region_name=REGION,
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        paginator = self.client().get_paginator("list_objects_v2")
        return [
            obj["Key"]
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix)
            for obj in page.get("Contents", [])
        ]


def aws_env(server: S3Server) -> dict[str, str]:
    """Environment for a subprocess that talks to `server` with the fake credentials."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
        "AWS_DEFAULT_REGION": REGION,
        # No instance-metadata lookups and few retries: a stopped endpoint fails fast.
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_MAX_ATTEMPTS": "2",
        "AWS_RETRY_MODE": "standard",
    }

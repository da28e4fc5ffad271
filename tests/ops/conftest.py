"""Fixtures of the node-level tests (salvage, two nodes)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.s3_server import S3Server
from helpers.tiny_pipeline import base_env


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    """A real S3 endpoint on 127.0.0.1 (moto's server), one per test module."""
    s3 = S3Server()
    s3.start()
    yield s3
    s3.stop()


@pytest.fixture
def bucket(server: S3Server) -> str:
    """A bucket of its own for each test on the module's endpoint."""
    name = f"node-{uuid.uuid4().hex[:12]}"
    server.create_bucket(name)
    return name


@pytest.fixture
def env(tmp_path: Path, server: S3Server) -> dict[str, str]:
    """The environment of a node's commands: the endpoint's credentials, git identity."""
    return base_env(tmp_path, server)

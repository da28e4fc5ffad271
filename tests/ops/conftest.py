"""Fixtures of the node-level tests (salvage, two nodes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers.s3_server import S3Server


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    """A real S3 endpoint on 127.0.0.1 (moto's server), one per test module."""
    s3 = S3Server()
    s3.start()
    yield s3
    s3.stop()

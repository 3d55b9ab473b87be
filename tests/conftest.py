"""Shared fixtures: a real redis-server on a free port, blob spools, free ports.

The redis-server is started once per test session (append-only persistence in a temp dir); each
test that asks for ``redis_url`` gets it flushed. Tests that restart Redis use ``redis_server``,
a private instance of their own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.common.blobs import BlobStore
from tests.support.redis_server import RedisServer, free_port

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def _session_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(_session_redis: RedisServer) -> str:
    """URL of a real, empty Redis (shared server, flushed for this test)."""
    client = redis.Redis.from_url(_session_redis.url)
    client.flushall()
    client.close()
    return _session_redis.url


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server this test may stop, kill and restart."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def tmp_spool(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "spool")


@pytest.fixture
def port() -> int:
    return free_port()


__all__ = ["free_port"]

"""Redis access: a clear sentence when unreachable, and transparent reconnect after a restart."""

from __future__ import annotations

import pytest

from services.common.redis_store import Keys, connect, redact
from tests.support.redis_server import RedisServer, free_port


def test_unreachable_redis_is_one_sentence() -> None:
    with pytest.raises(ValueError) as info:
        connect(f"redis://127.0.0.1:{free_port()}/0", retries=1)
    assert "is unreachable" in str(info.value) and "redis-server" in str(info.value)


def test_reconnects_after_restart_with_aof(redis_server: RedisServer) -> None:
    client = connect(redis_server.url)
    client.set("gyre:test:k", "v1")
    client.rpush("gyre:test:q", "a", "b")
    redis_server.restart()  # SIGTERM -> AOF flushed -> same port again
    assert client.get("gyre:test:k") == b"v1"  # same client object: retried transparently
    assert client.lrange("gyre:test:q", 0, -1) == [b"a", b"b"]


def test_keys_and_redaction() -> None:
    assert Keys("sched").key("job", "J1") == "gyre:sched:job:J1"
    with pytest.raises(ValueError):
        Keys("a:b")
    assert redact("redis://:secret@h:6379/0") == "redis://:***@h:6379/0"

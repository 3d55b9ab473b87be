"""Blob spool: atomic writes, arrays round-trip, keys cannot escape the spool."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.blobs import BlobStore


def test_roundtrip_and_arrays(tmp_spool: BlobStore) -> None:
    digest = tmp_spool.put("exec/e1/raw", b"hello")
    assert len(digest) == 64 and tmp_spool.get("exec/e1/raw") == b"hello"
    arr = np.arange(1_000_000, dtype=np.int32)
    n = tmp_spool.put_array("exec/e1/tokens.npy", arr)
    assert n >= arr.nbytes
    np.testing.assert_array_equal(tmp_spool.get_array("exec/e1/tokens.npy", mmap=True), arr)
    tmp_spool.delete("exec/e1/raw")
    assert not tmp_spool.exists("exec/e1/raw")
    with pytest.raises(KeyError, match="not found"):
        tmp_spool.get("exec/e1/raw")


@pytest.mark.parametrize("key", ["../x", "/etc/passwd", "a/../../b", "", "a//b", ".hidden"])
def test_keys_cannot_escape(tmp_spool: BlobStore, key: str) -> None:
    with pytest.raises(ValueError, match="invalid"):
        tmp_spool.put(key, b"x")


def test_sweep_tmp(tmp_spool: BlobStore) -> None:
    (tmp_spool.root / "a").mkdir()
    (tmp_spool.root / "a" / ".crash.tmp").write_bytes(b"partial")
    assert tmp_spool.sweep_tmp() == 1

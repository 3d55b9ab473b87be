"""The KV receive pool: a state's KV arrays reuse memory only once nothing made from the last
state's arrays is alive (numpy views, torch tensors), and idle memory stays under its cap."""

from __future__ import annotations

import gc

import numpy as np
import torch

from services.rollout.kv_transport import ReceivePool

PLAN = [((2, 1000, 64), np.dtype(np.float32)), ((2, 1000, 64), np.dtype(np.float32))]


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_memory_is_reused_only_after_every_array_and_tensor_is_gone() -> None:
    pool = ReceivePool(64 << 20)
    k, v = pool.arrays(PLAN)
    k[:] = 1.0
    first = _addr(k)
    tensor = torch.from_numpy(k[1])  # what the engine keeps until it installs the KV
    del k, v
    gc.collect()
    busy = pool.arrays(PLAN)  # the block is still in use: this one is fresh memory
    assert _addr(busy[0]) != first and pool.fresh == 2 and pool.reused == 0
    assert float(tensor.sum()) == 1000 * 64  # nobody wrote into the memory it still reads
    del tensor, busy
    gc.collect()
    third = pool.arrays(PLAN)  # two idle blocks of one size now: either serves
    assert pool.reused == 1
    again = pool.arrays(PLAN)
    assert pool.reused == 2 and first in (_addr(again[0]), _addr(third[0]))
    assert again[0].shape == (2, 1000, 64) and again[0].dtype == np.float32
    assert _addr(again[1]) - _addr(again[0]) >= again[0].nbytes  # arrays of one state never overlap


def test_idle_memory_stays_under_the_cap_and_zero_keeps_none() -> None:
    pool = ReceivePool(3 << 20)  # room for one idle 1-MiB-grain block of this plan (2 MiB)
    held = [pool.arrays(PLAN) for _ in range(3)]
    del held
    gc.collect()
    assert 0 < pool.idle_bytes <= 3 << 20
    off = ReceivePool(0)
    a = off.arrays(PLAN)
    del a
    gc.collect()
    assert off.idle_bytes == 0

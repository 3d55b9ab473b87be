"""services/common/memory.py: freed heap memory goes back to the OS (glibc)."""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# in a fresh process (the allocator's state there is known): a freed mmapped block raises glibc's
# mmap threshold, so later blocks of that size come from the heap and stay in the process when
# freed, as a long step's activations do; a small tensor allocated last pins the heap's top
SCENARIO = """
import json, torch
from services.common.memory import release_free_memory, rss_bytes
MiB = 1 << 20
release_free_memory()
first = torch.ones(2 * MiB // 4); del first
before = rss_bytes()
blocks = [torch.ones(MiB // 4) for _ in range(300)]
pin = torch.ones(16)
grown = rss_bytes()
del blocks
kept = rss_bytes()
released = release_free_memory()
after = rss_bytes()
print(json.dumps({"before": before // MiB, "grown": grown // MiB, "kept": kept // MiB, "after": after // MiB,
                  "released": released, "pin": pin.sum().item()}))
"""


def _glibc() -> bool:
    name = ctypes.util.find_library("c")
    try:
        return name is not None and hasattr(ctypes.CDLL(name), "malloc_trim")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc(), reason="not glibc: nothing to trim")
def test_freed_tensors_return_to_the_os() -> None:
    out = subprocess.run([sys.executable, "-c", SCENARIO], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["grown"] - m["before"] > 200, m
    assert m["kept"] > m["grown"] - 50, m  # free() alone kept the pages
    assert m["released"] and m["after"] < m["kept"] - 200, m  # release_free_memory gave them back

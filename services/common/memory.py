"""Give freed heap memory back to the operating system.

glibc keeps memory freed by ``free()`` inside its arenas: after a long execution's KV (engine) or a
64K-token step's activations (trainer) are freed, a process's RSS stays at its peak although
nothing uses that memory any more. ``release_free_memory()`` collects Python garbage and calls
glibc's ``malloc_trim(0)``, which returns free pages, the middle of the heap included, so a
service is back near its baseline once the work is done. Elsewhere (musl, macOS) it only collects
garbage. Costs milliseconds: call it after a unit of work (a training step, a cleared cache), not
per token."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import resource
from collections.abc import Callable

_trim: Callable[[int], int] | None = None
_looked = False


def _malloc_trim() -> Callable[[int], int] | None:
    global _trim, _looked
    if not _looked:
        _looked = True
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            fn = libc.malloc_trim
            fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            _trim = fn
        except (OSError, AttributeError):  # not glibc
            _trim = None
    return _trim


def release_free_memory() -> bool:
    """Collect garbage and return free heap memory to the OS; True when glibc released some."""
    gc.collect()
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


def rss_bytes() -> int:
    """This process's resident set size now (Linux /proc; else the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

"""Sandbox worker process of the reward service's ScorerPool (see services.reward.sandbox).

Reads length-prefixed pickles (scorer spec, score input) from stdin, runs the scorer and answers
with length-prefixed JSON on a private copy of stdout; fd 1 itself is pointed at stderr so a
scorer's prints cannot corrupt the protocol. Caps its own address space and file sizes.

    python -m services.reward.scorer_worker --memory-mb 1024
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import struct
import sys
import traceback
from typing import Any

_HEADER = struct.Struct("<I")


def _limit(memory_mb: int) -> None:
    mem = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    fsize = 64 * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))


def _read_exact(fh: object, n: int) -> bytes:
    data = fh.read(n)  # type: ignore[attr-defined]
    if len(data) != n:
        raise EOFError
    return bytes(data)


def main(argv: list[str]) -> int:
    memory_mb = int(argv[argv.index("--memory-mb") + 1]) if "--memory-mb" in argv else 1024
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _limit(memory_mb)
    from services.reward.scorers import ScoreInput, ScorerSpec, run_local

    stdin = sys.stdin.buffer
    while True:
        try:
            (size,) = _HEADER.unpack(_read_exact(stdin, _HEADER.size))
            spec_d, inp_d = pickle.loads(_read_exact(stdin, size))
        except EOFError:
            return 0
        reply: dict[str, Any]
        try:
            out = run_local(ScorerSpec(**spec_d), ScoreInput(**inp_d))
            reply = {"output": out.to_json()}
        except BaseException as exc:  # noqa: BLE001 - reported to the service, never fatal here
            if isinstance(exc, KeyboardInterrupt):
                raise
            tb = traceback.format_exception_only(type(exc), exc)
            reply = {"error": "".join(tb).strip()[-2000:]}
        blob = json.dumps(reply).encode()
        proto_out.write(_HEADER.pack(len(blob)) + blob)
        proto_out.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

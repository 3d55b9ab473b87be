"""Published weight versions: snapshots served to joining replicas, pushed to rollout engines.

After each step the core snapshots its weights to CPU as version v (``WeightStore.publish``);
``GetWeights(v)`` streams that snapshot as ``WeightChunk``s (the codec is shared with the rollout
engines: ``services.common.weights``), so a replica joining while the core is already computing
the next update still gets a consistent version. ``push_to_engines`` streams the same snapshot to
every engine's ``UpdateWeights`` in parallel; an engine only swaps to a version once its stream is
complete, so no engine mixes versions inside one request.

A sharded group's versions never exist whole in memory: its ranks gather one tensor at a time and
rank 0 writes each into a safetensors file as it comes (``SafetensorsWriter``); the store keeps the
file (``PublishedFile``), and serving or pushing it reads one tensor at a time.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.errors import DeadlineExceeded, NotFound
from services.common.logging import get_logger
from services.common.weights import WeightAssembler, chunk_state_dict

log = get_logger(__name__)


@dataclass(frozen=True)
class PublishReport:
    version: int
    num_bytes: int
    snapshot_s: float
    engines_s: float
    engines_ok: int
    engines_failed: tuple[str, ...]

    @property
    def mb_per_s(self) -> float:
        return (self.num_bytes / 1e6) / self.engines_s if self.engines_s > 0 else 0.0


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


class SafetensorsWriter:
    """Writes a safetensors file one tensor at a time, in any order: the header (every tensor's
    name, dtype, shape and place) is written first from the shapes alone, each tensor's bytes when
    it comes, so the writer never holds more than the tensor it is given. The file appears under
    its name only once complete (written as ``<name>.part``, renamed by ``close``).

    Lifecycle: SafetensorsWriter(path, [(name, dtype, shape), ...]) -> write(name, tensor) for each
    -> close() (or abort())."""

    def __init__(self, path: Path, tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        self.path = Path(path)
        header: dict[str, object] = {}
        at = 0
        for name, dtype, shape in tensors:
            if dtype not in _SAFETENSORS_DTYPES:
                raise ValueError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot hold")
            n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
            at += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._base = 8 + len(raw)
        self._spans = {name: h["data_offsets"] for name, h in header.items()}  # type: ignore[index]
        self._left = set(self._spans)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._part = self.path.with_name(self.path.name + ".part")
        self._f = open(self._part, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._f.truncate(self._base + at)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        begin, end = self._spans[name]
        t = tensor.detach().to("cpu").contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")
        if len(data) != end - begin:
            raise ValueError(f"tensor {name!r} has {len(data)} bytes; its header says {end - begin}")
        self._f.seek(self._base + begin)
        self._f.write(data)
        self._left.discard(name)

    def close(self) -> Path:
        if self._left:
            self.abort()
            raise ValueError(f"{len(self._left)} tensors were never written, e.g. {sorted(self._left)[0]!r}")
        self._f.close()
        os.replace(self._part, self.path)
        return self.path

    def abort(self) -> None:
        self._f.close()
        self._part.unlink(missing_ok=True)


class PublishedFile(Mapping[str, torch.Tensor]):
    """A published version in a safetensors file, read a tensor at a time (a sharded group's)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        spans = sorted((h["data_offsets"][0], name) for name, h in header.items())
        self._names = [name for _, name in spans]
        self.nbytes = sum(h["data_offsets"][1] - h["data_offsets"][0] for h in header.values())

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self._names:
            raise KeyError(name)
        with safe_open(str(self.path), framework="pt") as f:
            return f.get_tensor(name)  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


State = Mapping[str, torch.Tensor]


class WeightStore:
    """The last ``keep`` published versions (CPU tensors, or a sharded group's files: a file is
    removed with its version); readers block for a future version."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._cv = threading.Condition()
        self._versions: dict[int, State] = {}

    @property
    def latest(self) -> int:
        with self._cv:
            return max(self._versions, default=-1)

    def reset(self) -> None:
        """Forget every version (a new job starts its own lineage at its first version)."""
        with self._cv:
            for state in self._versions.values():
                _drop(state)
            self._versions.clear()
            self._cv.notify_all()

    def publish(self, model: torch.nn.Module, version: int) -> State:
        return self.publish_state(model.state_dict(), version)

    def publish_state(self, state: State, version: int) -> State:
        """Keep ``state`` as ``version``: a CPU copy of a whole model's tensors, or a ``PublishedFile``
        as it is; returns what is kept."""
        if not isinstance(state, PublishedFile):
            state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
        with self._cv:
            self._versions[version] = state
            for old in sorted(self._versions)[:-self.keep]:
                _drop(self._versions.pop(old))
            self._cv.notify_all()
        return state

    def get(self, version: int, timeout_s: float = 0.0) -> State:
        """Snapshot of ``version`` (-1 = latest); waits up to ``timeout_s`` for a future one."""
        with self._cv:
            if version < 0:
                if not self._versions:
                    raise NotFound("no weight version has been published yet")
                return self._versions[max(self._versions)]
            ok = self._cv.wait_for(lambda: version in self._versions or
                                   (self._versions and max(self._versions) > version), timeout=timeout_s)
            if version in self._versions:
                return self._versions[version]
            if ok:
                raise NotFound(f"weight version {version} is no longer kept (have {sorted(self._versions)})")
            raise DeadlineExceeded(f"weight version {version} was not published within {timeout_s}s "
                                   f"(latest {max(self._versions, default=-1)})")

    def chunks(self, version: int, *, chunk_bytes: int = 4 << 20, timeout_s: float = 0.0) -> Iterator[dict[str, object]]:
        state = self.get(version, timeout_s)
        v = version if version >= 0 else self.latest
        return chunk_state_dict(state, v, chunk_bytes=chunk_bytes)


def _drop(state: State) -> None:
    if isinstance(state, PublishedFile):
        state.path.unlink(missing_ok=True)


def state_bytes(state: State) -> int:
    if isinstance(state, PublishedFile):
        return state.nbytes
    return sum(t.numel() * t.element_size() for t in state.values())


def assemble(chunks: Iterator[dict[str, object]]) -> tuple[int, dict[str, torch.Tensor]]:
    """(version, state_dict) from a stream of WeightChunk field dicts."""
    asm = WeightAssembler()
    for c in chunks:
        asm.add(**c)  # type: ignore[arg-type]
    if asm.version is None:
        raise ValueError("empty weight stream")
    return asm.version, asm.state_dict()


def load_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``model`` in place (same names, shapes and dtypes required)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied weights may be streamed under one name only; anything else missing is an error.
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [m for m in missing if m not in tied]
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def push_to_engines(state: State, version: int, addresses: Sequence[str], *,
                    chunk_bytes: int = 4 << 20, timeout_s: float = 600.0,
                    restart: bool = False) -> tuple[float, int, list[str]]:
    """Stream ``state`` to each engine's UpdateWeights in parallel; (seconds, ok count, failed addrs)."""
    if not addresses:
        return 0.0, 0, []
    from services.rollout.client import EngineClient

    def push(addr: str) -> str | None:
        client = EngineClient(addr, timeout_s=timeout_s)
        try:
            client.update_weights(state, version, chunk_bytes=chunk_bytes, restart=restart)
            return None
        except Exception as exc:  # one unreachable engine must not stop the others' update
            log.warning("engine weight push failed", address=addr, version=version, error=str(exc))
            return addr
        finally:
            client.close()

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(8, len(addresses))) as pool:
        failed = [a for a in pool.map(push, addresses) if a is not None]
    return time.perf_counter() - start, len(addresses) - len(failed), failed

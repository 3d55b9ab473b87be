"""Published weight versions: snapshots served to joining replicas, pushed to rollout engines.

After each step the core snapshots its weights to CPU as version v (``WeightStore.publish``);
``GetWeights(v)`` streams that snapshot as ``WeightChunk``s (the codec is shared with the rollout
engines: ``services.common.weights``), so a replica joining while the core is already computing
the next update still gets a consistent version. ``push_to_engines`` streams the same snapshot to
every engine's ``UpdateWeights`` in parallel; an engine only swaps to a version once its stream is
complete, so no engine mixes versions inside one request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

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


class WeightStore:
    """The last ``keep`` published versions (CPU tensors); readers block for a future version."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._cap = 0  # the running job's own limit, 0: none (reset)
        self._cv = threading.Condition()
        self._versions: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def latest(self) -> int:
        with self._cv:
            return max(self._versions, default=-1)

    def reset(self, *, keep_at_most: int = 0) -> None:
        """Forget every version (a new job starts its own lineage at its first version);
        ``keep_at_most`` > 0: this job keeps no more versions than that (a sharded group's rank 0)."""
        with self._cv:
            self._cap = max(0, keep_at_most)
            self._versions.clear()
            self._cv.notify_all()

    def publish(self, model: torch.nn.Module, version: int) -> dict[str, torch.Tensor]:
        return self.publish_state(model.state_dict(), version)

    def publish_state(self, state: dict[str, torch.Tensor], version: int, *, copy: bool = True
                      ) -> dict[str, torch.Tensor]:
        """Keep ``state`` (a whole model's tensors) as ``version``, a CPU copy unless ``copy`` is False
        (tensors already copied for this, a sharded group's gathered weights); returns what is kept."""
        snapshot = {k: v.detach().to("cpu", copy=copy).contiguous() for k, v in state.items()}
        with self._cv:
            self._versions[version] = snapshot
            for old in sorted(self._versions)[:-(min(self.keep, self._cap) if self._cap else self.keep)]:
                del self._versions[old]
            self._cv.notify_all()
        return snapshot

    def get(self, version: int, timeout_s: float = 0.0) -> dict[str, torch.Tensor]:
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


def state_bytes(state: dict[str, torch.Tensor]) -> int:
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


def push_to_engines(state: dict[str, torch.Tensor], version: int, addresses: Sequence[str], *,
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

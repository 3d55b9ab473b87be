"""Reassemble a weight version streamed as chunks (common.proto ``WeightChunk``) into tensors.

The trainer streams each parameter as one or more byte slices (``offset_bytes`` within
``total_bytes``); slices of different parameters may interleave. ``WeightAssembler`` copies each
slice into a preallocated buffer per parameter and, once every byte of every parameter arrived,
hands out a ``state_dict`` of torch tensors for ``InferenceEngine.update_weights``. Memory is one
copy of the weights; no per-element Python work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Largest single tensor accepted (bytes): guards a corrupted header from allocating terabytes.
MAX_TENSOR_BYTES = 64 << 30


@dataclass
class _Tensor:
    dtype: str
    shape: tuple[int, ...]
    buffer: bytearray
    received: int = 0
    ranges: list[tuple[int, int]] = field(default_factory=list)


class WeightAssembler:
    """Collects the chunks of one weight version; ``state_dict()`` once ``complete``.

    Lifecycle: add(...) for every chunk (the last one has ``last=True``) -> state_dict().
    Raises ``ValueError`` on inconsistent chunks (mixed versions, overlapping or out-of-range
    slices, a dtype torch does not know, sizes that do not match dtype x shape).
    """

    def __init__(self) -> None:
        self.version: int | None = None
        self.saw_last = False
        self.num_bytes = 0
        self._tensors: dict[str, _Tensor] = {}

    def add(self, *, version: int, name: str, dtype: str, shape: tuple[int, ...], data: bytes,
            offset_bytes: int, total_bytes: int, last: bool, restart: bool = False) -> None:
        import torch

        if self.version is None:
            if version < 0:
                raise ValueError(f"weight version must be >= 0, got {version}")
            self.version = version
        elif version != self.version:
            raise ValueError(f"chunk of version {version} inside a stream of version {self.version}")
        if self.saw_last:
            raise ValueError("chunk received after the chunk marked last")
        self.saw_last = last
        if not name and not data and last:
            return  # a bare end-of-stream marker
        if not name:
            raise ValueError("weight chunk has an empty parameter name")
        tensor = self._tensors.get(name)
        if tensor is None:
            torch_dtype = getattr(torch, dtype, None)
            if not isinstance(torch_dtype, torch.dtype):
                raise ValueError(f"parameter {name!r}: unknown dtype {dtype!r}")
            if any(d < 0 for d in shape):
                raise ValueError(f"parameter {name!r}: negative dimension in shape {shape}")
            numel = 1
            for d in shape:
                numel *= d
            expected = numel * torch.empty((), dtype=torch_dtype).element_size()
            if total_bytes != expected:
                raise ValueError(f"parameter {name!r}: total_bytes {total_bytes} != {expected} "
                                 f"for dtype {dtype} and shape {list(shape)}")
            if total_bytes > MAX_TENSOR_BYTES:
                raise ValueError(f"parameter {name!r}: {total_bytes} bytes exceeds the limit")
            tensor = _Tensor(dtype=dtype, shape=tuple(shape), buffer=bytearray(total_bytes))
            self._tensors[name] = tensor
        elif (tensor.dtype, tensor.shape, len(tensor.buffer)) != (dtype, tuple(shape), total_bytes):
            raise ValueError(f"parameter {name!r}: chunks disagree on dtype/shape/size")
        end = offset_bytes + len(data)
        if offset_bytes < 0 or end > len(tensor.buffer):
            raise ValueError(f"parameter {name!r}: slice [{offset_bytes}, {end}) is outside "
                             f"its {len(tensor.buffer)} bytes")
        if any(offset_bytes < e and s < end for s, e in tensor.ranges):
            raise ValueError(f"parameter {name!r}: slice [{offset_bytes}, {end}) overlaps one received")
        tensor.ranges.append((offset_bytes, end))
        tensor.buffer[offset_bytes:end] = data
        tensor.received += len(data)
        self.num_bytes += len(data)

    @property
    def complete(self) -> bool:
        return self.saw_last and all(t.received == len(t.buffer) for t in self._tensors.values())

    def missing(self) -> list[str]:
        return [n for n, t in self._tensors.items() if t.received != len(t.buffer)]

    def state_dict(self) -> dict[str, "torch.Tensor"]:
        import torch

        if not self.saw_last:
            raise ValueError("weight stream ended without a chunk marked last")
        if self.missing():
            raise ValueError(f"weight stream incomplete: missing bytes of {self.missing()[:5]}")
        out: dict[str, torch.Tensor] = {}
        for name, t in self._tensors.items():
            dtype = getattr(torch, t.dtype)
            flat = torch.frombuffer(t.buffer, dtype=dtype) if t.buffer else torch.empty(0, dtype=dtype)
            out[name] = flat.reshape(t.shape)
        return out


def chunk_state_dict(state_dict: "Mapping[str, torch.Tensor]", version: int, *,
                     chunk_bytes: int = 4 << 20, restart: bool = False) -> "Iterator[dict[str, Any]]":
    """The chunks (as ``WeightChunk`` fields) that stream ``state_dict`` as weight ``version``
    (``restart``: a new job's first weights, installed whatever version the receiver holds)."""
    import torch

    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    names = list(state_dict)
    for i, name in enumerate(names):
        t = state_dict[name].detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")
        total = len(raw)
        starts = range(0, total, chunk_bytes) if total else [0]
        for s in starts:
            end = min(total, s + chunk_bytes)
            yield {"version": version, "name": name, "dtype": str(t.dtype).removeprefix("torch."),
                   "shape": list(t.shape), "data": bytes(raw[s:end]), "offset_bytes": s,
                   "total_bytes": total, "last": i == len(names) - 1 and end == total, "restart": restart}
    if not names:
        yield {"version": version, "name": "", "dtype": "", "shape": [], "data": b"",
               "offset_bytes": 0, "total_bytes": 0, "last": True, "restart": restart}

"""The engine's decode forward with fixed shapes, replayed from CUDA graphs on a GPU.

An eager decode step of a 28-layer model launches ~1,400 small kernels; at batch 1 the GPU is
busy under 4% of the time (bench/results/cuda.md). Captured once as a CUDA graph, a step is one
launch. A graph replays fixed shapes and addresses, so the step is made static:

    running rows 0..n-1 ──▶ bucket B >= n (1, 2, 4, 8, 16, 24, ... in steps of 8)
    host [2, B] int64 (last token, position; padding rows: token 0 at position 0)
         ──copy_──▶ static device inputs ──▶ forward over rows 0..B-1 of the slot buffers,
                                              keys 0..T-1 (T = token capacity), mask pos >= key
         ──▶ logits [B, 1, vocab]; the caller samples rows 0..n-1

Padding rows n..B-1 are free rows of ``SlotKV``: they write their key/value at position 0 of a
row no request owns (``add`` overwrites it before a request moves in) and attend to that key
alone. Free rows are kept finite (``SlotKV.keep_free_rows_finite``), so a padding row never
computes NaN, and rows never mix in a forward (every op is per row), so nothing of it reaches a
real row.

Graphs are captured lazily, one per bucket, in one memory pool per capacity, and dropped when:
- the slot buffers are reallocated (``SlotKV.generation``: grown by ``reserve``, shrunk by
  ``shrink_to_fit``); the old capacity's graphs and pool go with them, so memory stays bounded;
- weights are installed into different storage (``weights_installed`` compares the parameters'
  addresses; ``TorchEngine`` copies new weights in place, so a replay reads them as they are).

Without graphs (CPU, or ``cuda_graphs=False``) the same static forward runs eagerly: the tests
check it against the default decode path on CPU. A model whose forward cannot be captured (a host
sync inside, say) is logged once and decoded eagerly by this static forward from then on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.common.logging import get_logger
from services.rollout.kv_slots import SlotKV

log = get_logger(__name__)


def decode_buckets(max_batch_size: int) -> tuple[int, ...]:
    """Batch sizes a step is padded to: 1, 2, 4, 8, then steps of 8 up to ``max_batch_size``
    (at most 7 padding rows past 8, and few graphs: 11 for a batch of 64)."""
    sizes = [1]
    while sizes[-1] < max_batch_size:
        sizes.append(sizes[-1] * 2 if sizes[-1] < 8 else sizes[-1] + 8)
    return tuple(sizes)


@dataclass
class _Inputs:
    """Static device inputs of one bucket; a captured graph reads these very tensors."""

    host: np.ndarray  # int64 [2, B]: last token ids, positions (filled on the host each step)
    device: torch.Tensor  # the same on the device, copied in with one copy_()
    rows: torch.Tensor  # arange(B): row i writes its KV into slot row i

    @property
    def ids(self) -> torch.Tensor:
        return self.device[0][:, None]

    @property
    def pos(self) -> torch.Tensor:
        return self.device[1]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # the graph's output, overwritten by each replay


class StaticDecode:
    """Fixed-shape decode forward over ``slots`` (owned by the engine loop; not thread-safe).

    Lifecycle: built by the engine -> ``logits(last)`` once per decode step -> ``weights_installed()``
    after each weight install. With ``graphs`` (CUDA only) each (bucket, capacity) is captured on
    its first step and replayed after.
    """

    def __init__(self, model: torch.nn.Module, slots: SlotKV, *, cache_kw: str, max_batch_size: int,
                 graphs: bool) -> None:
        if graphs and slots.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the engine runs on {slots.device}")
        self.model, self.slots, self.cache_kw, self.graphs = model, slots, cache_kw, graphs
        self.buckets = decode_buckets(max_batch_size)
        self.captures = 0  # graphs captured so far (tests and logs: recaptures are visible)
        self._inputs: dict[int, _Inputs] = {}
        self._graphs: dict[int, _Graph] = {}
        self._pool: Any = None  # shared by this capacity's graphs
        self._generation = -1  # slots.generation the graphs were captured for
        self._weights = self._weight_addresses()
        slots.keep_free_rows_finite()

    @property
    def graph_count(self) -> int:
        return len(self._graphs)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def logits(self, last: np.ndarray) -> torch.Tensor:
        """One decode step of the running rows (``last``: each row's last token); returns their
        next-token logits ``[n, vocab]`` (a view valid until the next step)."""
        slots, n = self.slots, len(last)
        b = self.bucket(n)
        lens = slots.lens[:n]
        slots.reserve(slots=b, tokens=int(lens.max()) + 1)
        if slots.generation != self._generation:
            self.drop_graphs()
            self._generation = slots.generation
        inp = self._inputs_for(b)
        inp.host[0, :n], inp.host[1, :n] = last, lens
        inp.host[:, n:] = 0  # padding rows: token 0 at position 0
        inp.device.copy_(torch.from_numpy(inp.host))
        slots.bind_static(inp.rows, inp.pos)
        try:
            out = self._replay(b, inp) if self.graphs else self._forward(inp)
        finally:
            slots.end_step()
        return out[:n, -1]

    def weights_installed(self) -> None:
        """Call after new weights were installed: graphs that read other storage are dropped."""
        now = self._weight_addresses()
        if now != self._weights:
            self._weights = now
            self.drop_graphs()

    def drop_graphs(self) -> None:
        self._graphs.clear()
        self._pool = None

    # ----------------------------------------------------------------- internals
    def _inputs_for(self, b: int) -> _Inputs:
        inp = self._inputs.get(b)
        if inp is None:
            dev = self.slots.device
            inp = _Inputs(host=np.zeros((2, b), np.int64), device=torch.zeros((2, b), dtype=torch.long, device=dev),
                          rows=torch.arange(b, device=dev))
            self._inputs[b] = inp
        return inp

    def _forward(self, inp: _Inputs) -> torch.Tensor:
        """The step's forward; every shape follows from (bucket, token capacity) alone."""
        cols = torch.arange(self.slots.token_capacity, device=inp.device.device)
        mask = (cols[None, :] <= inp.pos[:, None])[:, None, None, :]  # row r sees keys 0..pos[r]
        out = self.model(input_ids=inp.ids, position_ids=inp.pos[:, None], attention_mask=mask, use_cache=True,
                         **{self.cache_kw: self.slots})
        return out.logits

    def _replay(self, b: int, inp: _Inputs) -> torch.Tensor:
        with torch.cuda.device(self.slots.device):  # streams and graphs of the engine's GPU, not GPU 0
            g = self._graphs.get(b)
            if g is None:
                try:
                    g = self._graphs[b] = self._capture(inp)
                except RuntimeError as exc:  # deliberate: a model that cannot be captured still decodes
                    log.exception("decode_graph_capture_failed", bucket=b, error=str(exc),
                                  detail="this engine decodes eagerly from now on")
                    self.graphs = False
                    self.drop_graphs()
                    return self._forward(inp)
            g.graph.replay()
        # read before any other replay: graphs of one pool may reuse each other's freed memory
        return g.logits

    def _capture(self, inp: _Inputs) -> _Graph:
        """The standard recipe: warm up on a side stream, then capture. The step's real inputs are
        already in place; warm-up and replay write the same keys/values at the same positions."""
        side = torch.cuda.Stream(device=self.slots.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(inp)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (RPC handlers staging weights) may use CUDA meanwhile
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self._forward(inp)
        self.captures += 1
        return _Graph(graph, logits)

    def _weight_addresses(self) -> tuple[int, ...]:
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        return tuple(t.data_ptr() for t in tensors)


__all__ = ["StaticDecode", "decode_buckets"]

"""Per-request KV caches packed into one slot buffer per layer, for batched decode steps.

Layout: layer l holds ``keys[l], values[l]`` of shape ``[slots, kv_heads, tokens, head_dim]``.
Running request r owns slot ``r`` (rows ``0..n-1`` are occupied, always contiguous) and its
cache fills ``[:, :lens[r]]``. A decode step writes one new key/value per row at ``lens[r]`` (a
scatter, no copy of the cache) and attends over ``[:n, :, :max(lens)+1]`` with a per-row length
mask, so requests of different lengths share one forward without padding copies.

Capacity grows geometrically (slots x2, tokens x1.25 in 256-token pages); when a request leaves, the last
row moves into its slot (one copy of that request's cache) to keep rows contiguous. The price of
a rectangular buffer: memory is ``slots x longest request``; a paged layout would remove that,
at the cost of a custom attention kernel.

The object also acts as the ``cache`` a transformers decoder layer calls ``update()`` on during
the decode step (duck-typed: only ``update`` is used when a 4-D mask and position ids are given).

Static decode (``static_decode.py``, CUDA graphs) binds fixed-shape row/position tensors with
``bind_static`` instead of ``begin_step``: ``update()`` then writes at those device tensors and
returns the first ``rows`` rows over the whole token capacity, so a step's shapes depend only on
(bucket, capacity). Its padding rows are free rows, which it reads: ``keep_free_rows_finite()``
makes every row, not only the occupied ones, finite. ``generation`` counts reallocations (a
captured graph holds the buffers' addresses and is stale once it changes).
"""

from __future__ import annotations

import numpy as np
import torch


class SlotKV:
    """Slot buffer for ``num_layers`` layers; not thread-safe (owned by the engine loop)."""

    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, slots: int = 4, tokens: int = 256) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.n = 0
        self.freed_bytes = 0  # ever freed by reallocations (grown or shrunk buffers)
        self.generation = 0  # reallocations so far: the buffers' addresses change with it
        self.zero_free_rows = False  # keep_free_rows_finite() sets it (static decode reads free rows)
        self.lens = np.zeros(slots, dtype=np.int64)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._alloc(slots, tokens)
        # set by begin_step() for the decode forward
        self._rows: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None
        self._view_rows = self._view_len = 0

    @property
    def slot_capacity(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def token_capacity(self) -> int:
        return int(self.keys[0].shape[2])

    def _alloc(self, slots: int, tokens: int) -> None:
        # torch.empty, not zeros: touching (memset) the whole rectangle costs more than the copy.
        # Invariant instead: every OCCUPIED row is finite over [0, tokens) (masked positions get
        # softmax weight 0, and 0 * finite = 0, but 0 * NaN = NaN); free rows are never read.
        # Static decode does read free rows (its padding rows): then every row starts at zero.
        shape = (slots, self.kv_heads, tokens, self.head_dim)
        new = torch.zeros if self.zero_free_rows else torch.empty
        new_k = [new(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        new_v = [new(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        if self.keys and self.n:
            keep = min(self.token_capacity, tokens)
            for old, buf in zip(self.keys + self.values, new_k + new_v):
                buf[: self.n, :, :keep].copy_(old[: self.n, :, :keep])
                buf[: self.n, :, keep:].zero_()
        self.freed_bytes += sum(t.numel() * t.element_size() for t in self.keys + self.values)
        self.keys, self.values = new_k, new_v
        self.generation += 1
        lens = np.zeros(slots, dtype=np.int64)
        lens[: self.n] = self.lens[: self.n]
        self.lens = lens

    def keep_free_rows_finite(self) -> None:
        """From now on free rows are finite too (zeros, or an earlier request's finite KV)."""
        if not self.zero_free_rows:
            self.zero_free_rows = True
            for buf in self.keys + self.values:
                buf[self.n:].zero_()

    def reserve(self, *, slots: int, tokens: int) -> None:
        """Make room for ``slots`` rows of ``tokens`` tokens (grows geometrically; never shrinks)."""
        s, t = self.slot_capacity, self.token_capacity
        if slots <= s and tokens <= t:
            return
        while s < slots:
            s *= 2
        if tokens > t:
            # x1.25 headroom in 256-token pages: decode appends rarely reallocate, while one long
            # import does not double the rectangle (memory is slots x tokens)
            t = max(t, -(-int(tokens * 1.25) // 256) * 256)
        self._alloc(s, t)

    def shrink_to_fit(self, min_tokens: int = 256) -> None:
        """Release memory after long requests left (only when at most a quarter is used)."""
        used = int(self.lens[: self.n].max()) + 1 if self.n else 0
        t = self.token_capacity
        if t > min_tokens and used * 4 <= t:
            while t > min_tokens and used * 2 <= t // 2:
                t //= 2
            self._alloc(self.slot_capacity, max(t, min_tokens))

    def add(self, kv: list[tuple[torch.Tensor, torch.Tensor]], length: int, extra_tokens: int = 1) -> int:
        """Append a request whose cache is ``kv`` (per layer ``[kv_heads, length, head_dim]``, or a
        leading batch dim of 1); returns its slot. ``extra_tokens`` reserves room to decode."""
        self.reserve(slots=self.n + 1, tokens=length + extra_tokens)
        slot = self.n
        for layer, (k, v) in enumerate(kv):
            if k.dim() == 4:
                k, v = k[0], v[0]
            for buf, src in ((self.keys[layer], k), (self.values[layer], v)):
                buf[slot, :, :length].copy_(src[:, :length])
                buf[slot, :, length:].zero_()  # keep the row finite past its length (see _alloc)
        self.lens[slot] = length
        self.n += 1
        return slot

    def remove(self, slot: int) -> int | None:
        """Free ``slot``; the last row moves into it. Returns the slot that moved (now ``slot``)."""
        last = self.n - 1
        moved = None
        if slot != last:
            t = int(self.lens[last])
            for buf in self.keys + self.values:
                buf[slot, :, :t].copy_(buf[last, :, :t])
            self.lens[slot] = self.lens[last]
            moved = last
        self.lens[last] = 0
        self.n -= 1
        return moved

    def export(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of one request's cache, per layer ``[kv_heads, len, head_dim]``."""
        t = int(self.lens[slot])
        return [(k[slot, :, :t].clone(), v[slot, :, :t].clone()) for k, v in zip(self.keys, self.values)]

    def begin_step(self) -> torch.Tensor | None:
        """Prepare a decode step over rows ``0..n-1``; returns the bool attention mask
        ``[n, 1, 1, max_len + 1]`` (row r sees its ``lens[r]`` cached tokens and the new one), or
        None when every row has the same length (one row alone, say): each sees every key."""
        lens = self.lens[: self.n]
        longest = int(lens.max())
        self.reserve(slots=self.n, tokens=longest + 1)
        self._view_rows, self._view_len = self.n, longest + 1
        self._pos = torch.from_numpy(lens.copy()).to(self.device)
        self._rows = torch.arange(self.n, device=self.device)
        if int(lens.min()) == longest:
            return None
        cols = torch.arange(self._view_len, device=self.device)
        return (cols[None, :] <= self._pos[:, None])[:, None, None, :]

    def bind_static(self, rows: torch.Tensor, pos: torch.Tensor) -> None:
        """Prepare a static decode step: ``update()`` writes row ``rows[i]``'s key/value at
        ``pos[i]`` (device tensors of a fixed length, padding included; the caller reserved room)
        and returns rows ``0..len(rows)-1`` over the whole token capacity. No mask is built here:
        the caller's covers the capacity. ``end_step()`` closes the step as usual."""
        assert len(rows) <= self.slot_capacity and self.zero_free_rows, "reserve() and keep_free_rows_finite() first"
        self._rows, self._pos = rows, pos
        self._view_rows, self._view_len = len(rows), self.token_capacity

    def positions(self) -> torch.Tensor:
        """Position id of each row's new token, ``[n, 1]`` (= its cached length)."""
        assert self._pos is not None, "begin_step() first"
        return self._pos[:, None]

    def end_step(self) -> None:
        self.lens[: self.n] += 1
        self._rows = self._pos = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers cache hook: store the step's [n, kv_heads, 1, head_dim] keys/values at each
        row's own position and return the views the attention reads."""
        assert self._rows is not None and self._pos is not None, "update() outside a decode step"
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        k_buf[self._rows, :, self._pos] = key_states[:, :, 0]
        v_buf[self._rows, :, self._pos] = value_states[:, :, 0]
        return k_buf[: self._view_rows, :, : self._view_len], v_buf[: self._view_rows, :, : self._view_len]

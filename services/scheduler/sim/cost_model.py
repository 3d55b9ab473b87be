"""The cluster cost model shared by the simulator, the lower bound and the benchmark.

A cell is one independently switchable group of accelerators. In ROLLOUT it hosts an inference
engine whose KV cache holds up to ``slots = kv_capacity_tokens // execution_kv_tokens``
executions (each reserves its context window for its whole life, model calls and tool time
alike, so nothing is ever evicted or recomputed). A model call costs "solo seconds":

    solo_s = prompt_tokens / prefill_tok_s + gen_tokens / decode_tok_s

and a cell serves its active calls by processor sharing at speed

    speed(n) = 1 / (1 + batch_slowdown_at_full * (n - 1) / (slots - 1))

per call: decode is memory-bound, so batching is nearly free up to KV capacity (at a full cell
each call runs ``1 + batch_slowdown_at_full`` times slower, the cell does ``slots / (1 + b)``
calls' worth of work). In TRAIN a cell processes ``train_tok_s`` trajectory tokens per second
(data-parallel replicas share the step's backlog; ``max_train_tok_s`` caps them together when the
cells share one host's compute). Switching costs ``rollout_to_train_s`` /
``train_to_rollout_s``; migrating an execution moves its context's KV
(``kv_bytes_per_token``) at ``migration_gb_s``; publishing an update (optimizer step +
broadcast) takes ``publish_s`` and pauses rollout engines for ``weight_sync_s``.
See bench/COST_MODEL.md for the rationale and defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Per-cell rates and costs of the simulated cluster."""

    num_cells: int
    """Cells in the pool, the core (always TRAIN) included."""
    kv_capacity_tokens: int = 1_048_576
    """KV-cache capacity of one rollout cell, in tokens."""
    execution_kv_tokens: int = 262_144
    """KV one execution reserves for its life (its context window; harnesses compact beyond it)."""
    decode_tok_s: float = 50.0
    """Decode speed of one request alone on a cell, tokens/s."""
    batch_slowdown_at_full: float = 0.10
    """Per-request decode slowdown when the cell's KV is full (0.10: 10% slower than alone)."""
    prefill_tok_s: float = 8_000.0
    """Prefill speed of one request alone on a cell, tokens/s."""
    train_tok_s: float = 2_000.0
    """Trajectory tokens one TRAIN cell processes per second (forward + backward)."""
    max_train_tok_s: float = 0.0
    """Training throughput of all TRAIN cells together (cells that share one host's compute, such
    as every cell of a small box); 0: no cap, each cell brings its own hardware."""
    rollout_to_train_s: float = 8.5
    """Role switch ROLLOUT -> TRAIN (stop engine, start replica, pull weights from the core)."""
    train_to_rollout_s: float = 3.5
    """Role switch TRAIN -> ROLLOUT (leave the replica group, start engine with new weights)."""
    idle_to_rollout_s: float = 3.5
    """First assignment of a fresh cell to ROLLOUT."""
    idle_to_train_s: float = 8.5
    """First assignment of a fresh cell to TRAIN."""
    migration_gb_s: float = 25.0
    """KV migration bandwidth between two cells, GB/s (one transfer at a time per execution)."""
    kv_bytes_per_token: int = 131_072
    """KV bytes per context token (e.g. 64 layers x 8 KV heads x 128 dims x 2 x fp8)."""
    publish_s: float = 20.0
    """Optimizer step and weight publication after the last micro-batch of a step."""
    weight_sync_s: float = 2.0
    """Pause of a ROLLOUT cell's decoding while it loads newly published weights."""

    def __post_init__(self) -> None:
        if self.num_cells < 2:
            raise ValueError(f"num_cells must be >= 2 (one core + one more), got {self.num_cells}")
        if self.execution_kv_tokens < 1 or self.kv_capacity_tokens < self.execution_kv_tokens:
            raise ValueError("kv_capacity_tokens must hold at least one execution_kv_tokens window "
                             f"(got {self.kv_capacity_tokens} < {self.execution_kv_tokens})")
        for name in ("decode_tok_s", "prefill_tok_s", "train_tok_s", "migration_gb_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("batch_slowdown_at_full", "rollout_to_train_s", "train_to_rollout_s", "idle_to_rollout_s",
                     "idle_to_train_s", "publish_s", "weight_sync_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_train_tok_s < 0:
            raise ValueError(f"max_train_tok_s must be >= 0 (0: no cap), got {self.max_train_tok_s}")
        if self.kv_bytes_per_token < 0:
            raise ValueError(f"kv_bytes_per_token must be >= 0, got {self.kv_bytes_per_token}")

    @property
    def slots(self) -> int:
        """Executions one rollout cell hosts at once (KV capacity binding)."""
        return self.kv_capacity_tokens // self.execution_kv_tokens

    def speed(self, n_active: int) -> float:
        """Solo-seconds of progress per second for each of ``n_active`` concurrent model calls."""
        if n_active <= 1 or self.slots <= 1:
            return 1.0
        return 1.0 / (1.0 + self.batch_slowdown_at_full * (n_active - 1) / (self.slots - 1))

    def train_rate(self, train_cells: int) -> float:
        """Tokens/s that ``train_cells`` TRAIN cells process together (data-parallel, capped by
        ``max_train_tok_s`` when set)."""
        rate = train_cells * self.train_tok_s
        return min(rate, self.max_train_tok_s) if self.max_train_tok_s > 0 else rate

    def migration_s(self, context_tokens: int) -> float:
        """Time to move one execution's KV (its context, capped at the window) to another cell."""
        tokens = min(context_tokens, self.execution_kv_tokens)
        return tokens * self.kv_bytes_per_token / (self.migration_gb_s * GB)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

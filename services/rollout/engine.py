"""The inference-engine seam of a ROLLOUT cell: request/event/migration types and the abstract engine.

Two implementations sit behind ``InferenceEngine``: ``torch_engine.TorchEngine`` (a transformers
causal LM with continuous batching, the default) and ``sglang_engine.SGLangEngine`` (an adapter to
an sglang server on GPU hosts). The gRPC servicer and the gateway only see this module.

Threading contract::

    caller threads ──submit/cancel/export/import/update_weights──▶ engine (thread-safe)
    engine loop thread ──on_event(TokenEvent)──▶ caller callback (must not block)

Every ``TokenEvent`` carries the weight version that produced its tokens; a request's final event
has ``finished=True`` and a ``finish_reason`` (``"stop"``, ``"length"``, ``"aborted"``,
``"migrated"`` after ``export_request`` or ``"error"``).

No torch at module top: the gateway and tests of pure logic import this without loading torch.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from services.rollout.grammar import GrammarSpec

if TYPE_CHECKING:
    import torch

FINISH_REASONS = ("stop", "length", "aborted", "migrated", "error")
# Seeds are uint64 on the wire (common.proto SamplingParams.seed).
MAX_SEED = (1 << 64) - 1


MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy (top_p/top_k/seed are then irrelevant)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # None: the engine picks one and reports it in TokenEvent.seed
    top_logprobs: int = 0  # also report the this-many most likely tokens of each position (0..20)
    # the output must match this grammar (services/rollout/grammar.py); None: unconstrained
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        if self.seed is not None and not (0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenRequest:
    """One model call as the engine sees it (TITO: token ids in)."""

    request_id: str
    prompt_ids: np.ndarray  # int32[P]
    params: SamplingParams
    execution_id: str = ""
    call_id: str = ""
    agent_id: str = ""
    role: str = "main"

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        ids = np.asarray(self.prompt_ids)
        if ids.ndim != 1:
            raise ValueError(f"prompt_ids must be a 1-D array of token ids, got shape {ids.shape}")
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt_ids must be integer token ids, got dtype {ids.dtype}")
        object.__setattr__(self, "prompt_ids", ids.astype(np.int32, copy=False))


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of one request from one engine step (one or more tokens), or its end."""

    request_id: str
    token_ids: np.ndarray  # int32[k]
    logprobs: np.ndarray  # float32[k]
    finished: bool
    finish_reason: str | None
    weight_version: int
    # Index of token_ids[0] within the request's output (re-attached streams skip duplicates).
    offset: int = 0
    # Seed the request samples with (the caller's, or the one the engine picked).
    seed: int = 0
    # With params.top_logprobs = K: the K most likely ids of each position and their logprobs
    # (int32[k, K], float32[k, K]; the same distribution the token's own logprob is from).
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    # Context tokens whose KV came from the engine's prefix cache (not prefilled) for this request.
    cached_tokens: int = 0
    # Grammar-constrained requests only (else None), per token: the grammar allowed no other token
    # (bool[k]), and the token's logprob under the unmasked policy (float32[k]; ``logprobs`` are
    # the masked distribution's, the one it was sampled from). See services/rollout/grammar.py.
    forced: np.ndarray | None = None
    policy_logprobs: np.ndarray | None = None


@dataclass
class MigrationState:
    """Everything needed to resume a request on another engine with an identical continuation.

    Invariants: ``generated_logprobs`` has the length of ``generated_ids``; ``kv`` is empty (the
    target re-prefills) or holds one (keys, values) pair per layer, each
    ``[kv_heads, prompt_len + len(generated_ids) - 1, head_dim]``: the last generated token is
    not in the cache yet, it is the next step's input. ``kv_dtype`` names the torch dtype; numpy
    has no bfloat16, so bfloat16 KV travels as uint16 bit patterns.
    """

    request: GenRequest
    generated_ids: np.ndarray  # int32[G]
    generated_logprobs: np.ndarray  # float32[G]
    rng_state: bytes
    weight_version: int
    kv: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    kv_dtype: str = "float32"

    def __post_init__(self) -> None:
        self.generated_ids = np.asarray(self.generated_ids, dtype=np.int32)
        self.generated_logprobs = np.asarray(self.generated_logprobs, dtype=np.float32)
        if self.generated_ids.shape != self.generated_logprobs.shape or self.generated_ids.ndim != 1:
            raise ValueError(
                f"generated_ids {self.generated_ids.shape} and generated_logprobs "
                f"{self.generated_logprobs.shape} must be 1-D arrays of the same length"
            )
        if self.kv:
            want = len(self.request.prompt_ids) + len(self.generated_ids) - 1
            for i, (k, v) in enumerate(self.kv):
                if k.ndim != 3 or k.shape != v.shape or k.shape[1] != want:
                    raise ValueError(
                        f"kv layer {i}: keys {k.shape} / values {v.shape} must both be "
                        f"[kv_heads, {want}, head_dim] (prompt + generated - 1 tokens)"
                    )

    @property
    def kv_tokens(self) -> int:
        return int(self.kv[0][0].shape[1]) if self.kv else 0

    def nbytes(self) -> int:
        """Bytes of array payload (what a transport moves, less its small header)."""
        n = self.request.prompt_ids.nbytes + self.generated_ids.nbytes + self.generated_logprobs.nbytes
        n += len(self.rng_state)
        return n + sum(k.nbytes + v.nbytes for k, v in self.kv)


EventCallback = Callable[[TokenEvent], None]


class InferenceEngine(abc.ABC):
    """A model that serves many concurrent requests; thread-safe.

    Lifecycle: construct -> start() -> submit/import/... -> stop(drain). Weight versions only
    grow; every TokenEvent reports the version its tokens were computed under.
    """

    vocab_size: int
    max_context: int
    weight_version: int
    model_name: str

    @abc.abstractmethod
    def start(self) -> None:
        """Start the engine loop; requests may be submitted after this returns."""

    @abc.abstractmethod
    def stop(self, drain: bool = False) -> None:
        """Stop the loop. ``drain``: finish running requests first; else they end ``aborted``."""

    @abc.abstractmethod
    def submit(self, req: GenRequest, on_event: EventCallback) -> None:
        """Queue a request; raises ValueError on bad input (ids, lengths, params, duplicate id)."""

    @abc.abstractmethod
    def cancel(self, request_id: str) -> bool:
        """End a request with ``aborted``; False if the engine does not know it."""

    @abc.abstractmethod
    def export_request(self, request_id: str) -> MigrationState:
        """Pause the request after its current token, remove it and return its full state.

        Its callback receives a final event with ``finish_reason="migrated"``.
        """

    @abc.abstractmethod
    def import_request(self, state: MigrationState, on_event: EventCallback) -> None:
        """Resume an exported request here; its next tokens equal the unmigrated run's."""

    @abc.abstractmethod
    def reprefill_request(
        self,
        req: GenRequest,
        generated_ids: np.ndarray,
        generated_logprobs: np.ndarray,
        rng_state: bytes | None,
        weight_version: int,
        on_event: EventCallback,
    ) -> None:
        """Fallback resume without KV: recompute it from prompt + generated tokens."""

    @abc.abstractmethod
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, *, restart: bool = False) -> None:
        """Install a new weight version between engine steps (see the engine's version policy).
        ``restart``: a new job's first weights, accepted whatever version the engine holds."""

    @abc.abstractmethod
    def active_requests(self) -> list[str]:
        """Ids of the requests queued or running here."""

    @abc.abstractmethod
    def load(self) -> dict[str, int]:
        """``{"active": n, "kv_tokens": n, "capacity_tokens": n}``."""

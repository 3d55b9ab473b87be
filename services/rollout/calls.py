"""Domain types of a model call as it crosses gateway <-> engine (no gRPC here).

``Piece`` is one chunk of a streamed generation (tokens with their log-probs, or the end), as
engine streams and the gateway hand them on. ``CallMeta`` identifies the call for routing and
for its TITO record. ``MigrationReport`` is what moving one request cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.common.errors import InvalidArgument, Unavailable
from services.common.roles import AGENT_ROLES

TRANSPORTS = ("auto", "ucx", "tcp", "reprefill")
# Generation must leave room for at least this many new tokens (else the prompt is "beyond context").
MIN_NEW_TOKENS = 1


class EngineLost(Unavailable):
    """The connection to an engine broke (process died, network) or its stream ended early."""


@dataclass(frozen=True)
class CallMeta:
    job_id: str = ""
    execution_id: str = ""
    call_id: str = ""
    agent_id: str = ""
    role: str = "main"
    attempt: int = 0  # the execution's lease attempt (0: not given)

    def __post_init__(self) -> None:
        if self.attempt < 0:
            raise InvalidArgument(f"attempt must be >= 0, got {self.attempt}")
        if self.role not in AGENT_ROLES:
            raise InvalidArgument(f"role must be one of {AGENT_ROLES}, got {self.role!r}")

    @property
    def sticky_key(self) -> tuple[str, str] | None:
        return (self.execution_id, self.agent_id) if self.execution_id else None


@dataclass(frozen=True)
class Piece:
    """New tokens of a request (``offset`` = index of ``token_ids[0]`` in its output), or its end."""

    request_id: str
    token_ids: np.ndarray  # int32[k]
    logprobs: np.ndarray  # float32[k]
    offset: int
    finished: bool = False
    finish_reason: str = ""
    weight_version: int = 0
    seed: int = 0
    # Engine streams only: the request moved; continue with Attach at this address.
    migrated_to: str = ""
    # int32[k, K] / float32[k, K]: each token position's K most likely ids (top_logprobs > 0)
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    cached_tokens: int = 0  # prompt tokens the engine took from its prefix cache
    # grammar-constrained requests only: bool[k] no other token allowed / float32[k] unmasked logprob
    forced: np.ndarray | None = None
    policy_logprobs: np.ndarray | None = None

    def __post_init__(self) -> None:
        assert len(self.token_ids) == len(self.logprobs), "one logprob per token"


FINISHED = "finished"


@dataclass(frozen=True)
class MigrationReport:
    request_id: str
    source_cell_id: str
    target_cell_id: str
    transport: str  # "ucx" | "tcp" | "reprefill" | FINISHED (ended on the source first: nothing moved)
    bytes: int
    duration_s: float
    kv_tokens: int
    ok: bool
    error: str = ""


def check_prompt(prompt_ids: np.ndarray, *, vocab_size: int, max_context: int) -> None:
    """Reject empty, out-of-vocab or too long prompts with a precise message (vectorized)."""
    if prompt_ids.ndim != 1 or len(prompt_ids) == 0:
        raise InvalidArgument("prompt_ids must be a non-empty list of token ids")
    if vocab_size > 0:
        bad = (prompt_ids < 0) | (prompt_ids >= vocab_size)
        if bad.any():
            i = int(np.argmax(bad))
            raise InvalidArgument(f"prompt_ids[{i}] = {int(prompt_ids[i])} is outside the vocabulary "
                                  f"[0, {vocab_size}) ({int(bad.sum())} out-of-vocab ids)")
    if max_context > 0 and len(prompt_ids) + MIN_NEW_TOKENS > max_context:
        raise InvalidArgument(f"prompt of {len(prompt_ids)} tokens leaves no room to generate within the "
                              f"model context of {max_context} tokens")


def check_stop_ids(stop_token_ids: tuple[int, ...], *, vocab_size: int) -> None:
    if vocab_size > 0 and any(not 0 <= t < vocab_size for t in stop_token_ids):
        raise InvalidArgument(f"stop_token_ids {list(stop_token_ids)} must lie in [0, {vocab_size})")


def concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


@dataclass(frozen=True)
class CallResult:
    """A finished call. ``weight_version`` is the oldest version that produced an output token."""

    request_id: str
    output_ids: np.ndarray
    output_logprobs: np.ndarray
    finish_reason: str
    weight_version: int
    seed: int
    prompt_len: int
    num_migrations: int = 0
    num_reprefills: int = 0
    cell_id: str = ""
    cached_tokens: int = 0  # prompt tokens the (first) engine did not prefill: prefix cache hits

"""Config of the trajectory service: TOML section ``[trajectory]``, env ``GYRE_TRAJECTORY_<FIELD>``,
or ``--field value`` flags (see ``services.common.config``)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import ServerConfig, check, setting


@dataclass(frozen=True, kw_only=True)
class TrajectoryConfig(ServerConfig):
    """The trajectory service (records -> trees -> packed micro-batches)."""

    max_paths: int = setting(0, "Root-to-leaf paths kept per execution (role priority, then record order); "
                                "0 = all paths.")
    token_budget: int = setting(16384, "Default micro-batch size, tokens (a step may set its own).")
    kv_budget_tokens: int = setting(0, "tree_split 'pieces': the largest tree trained whole, its keys/values "
                                       "kept for the later pieces (memory: 2 x layers x kv width per token); a "
                                       "larger tree is cut into chunks of at most this many tokens whose root "
                                       "paths are recomputed as context instead (never fewer than the step's token "
                                       "budget). 0 = no limit.")
    tree_split: str = setting("pieces", "How a tree larger than the token budget trains: 'pieces' (the whole "
                                        "tree in DFS pieces of at most the budget, each attending to earlier "
                                        "pieces' kept keys/values: every tree token computed once) or 'context' "
                                        "(DFS chunks, each with its root path copied in as context).")
    vocab_size: int = setting(0, "Token ids must be < vocab_size; 0 = only the int32 range is checked.")
    max_record_tokens: int = setting(4_194_304, "Largest record (new prompt tokens + output), tokens.")
    batch_lease_s: float = setting(1800.0, "A handed-out micro-batch not acknowledged within this many seconds "
                                           "is handed to another trainer replica.")
    max_in_flight: int = setting(2, "Unacknowledged micro-batches one trainer replica may hold.")
    stream_poll_s: float = setting(1.0, "How often a waiting batch stream checks that its consumer is still "
                                        "connected, seconds.")
    collect_done_steps: bool = setting(True, "Delete a step's record and batch payloads from the spool once every "
                                             "batch is acknowledged (outcomes and stats stay in Redis).")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.max_paths >= 0, "max_paths", self.max_paths, ">= 0 (0 = all paths)")
        check(self.token_budget >= 16, "token_budget", self.token_budget, "at least 16 tokens")
        check(self.tree_split in ("pieces", "context"), "tree_split", self.tree_split, "'pieces' or 'context'")
        check(self.kv_budget_tokens >= 0, "kv_budget_tokens", self.kv_budget_tokens,
              ">= 0 (0: no limit; a step's token budget is its least)")
        check(self.vocab_size >= 0, "vocab_size", self.vocab_size, ">= 0 (0 = unchecked)")
        check(self.max_record_tokens >= 1, "max_record_tokens", self.max_record_tokens, "at least 1 token")
        check(self.batch_lease_s > 0, "batch_lease_s", self.batch_lease_s, "> 0 seconds")
        check(self.max_in_flight >= 1, "max_in_flight", self.max_in_flight, "at least 1")
        check(self.stream_poll_s > 0, "stream_poll_s", self.stream_poll_s, "> 0 seconds")

    @property
    def path_cap(self) -> int | None:
        """``max_paths`` as the tree API takes it (None = all paths)."""
        return self.max_paths or None

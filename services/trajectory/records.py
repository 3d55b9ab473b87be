"""TITO records as domain types, their JSONL form, and the delta encoder the gateway uses.

No gRPC here: the rollout gateway imports ``DeltaEncoder`` and ``TitoCall`` from this module.

A record's prompt is either full (``prompt_ids``) or delta-encoded (``PromptDelta``)::

    prompt = (prompt_ids + output_ids of base_call_id)[:shared_prefix_len] + new_ids

Every prompt repeats its whole context, so full prompts summed over an execution grow
quadratically with its horizon; deltas keep records, storage and tree building linear in the
unique tokens. ``DeltaEncoder`` turns full prompts into deltas against the earlier call of the
same execution that shares the longest prefix (found in a token trie of the execution).

JSONL (DESIGN.md, "Formats"): one model call per line
``{"execution_id", "call_id", "agent_id", "role", "prompt_ids" | "delta", "output_ids",
"output_logprobs", "weight_version"}`` (a grammar-constrained call also ``"output_forced"`` and
``"output_policy_logprobs"``, see ``TitoCall``) plus per-execution lines
``{"execution_id", "group_id", "status", "reward"}`` (or a ``reward`` field on the last call).
"""

from __future__ import annotations

import enum
import json
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from services.common.roles import AgentRole
from services.trajectory.trie import ROOT, TokenTrie

INT32_MAX = 2**31 - 1
# Engines report log-probs computed in reduced precision; tiny positive values are rounding.
LOGPROB_TOLERANCE = 1e-3


class Status(enum.IntEnum):
    """How an execution ended; values equal gyre.v1.ExecutionStatus."""

    FINISHED = 1
    TIMEOUT = 2
    FAILED = 3

    @classmethod
    def parse(cls, value: Any) -> Status:
        if isinstance(value, Status):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        elif isinstance(value, str):
            name = value.strip().upper().removeprefix("EXECUTION_STATUS_")
            if name in cls.__members__:
                return cls[name]
        raise ValueError(f"status {value!r} is unknown; expected finished, timeout or failed")


def token_array(values: Any, what: str) -> np.ndarray:
    """``values`` as an int32 array of token ids, or ValueError naming ``what``."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a flat list of token ids")
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must hold integer token ids, got {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        raise ValueError(f"{what} holds a negative token id ({lo})")
    if hi > INT32_MAX:
        raise ValueError(f"{what} holds a token id ({hi}) larger than int32")
    return arr.astype(np.int32, copy=False)


@dataclass(frozen=True)
class PromptDelta:
    """prompt = full_sequence(base_call_id)[:shared_prefix_len] + new_ids; no base -> prompt = new_ids."""

    base_call_id: str
    shared_prefix_len: int
    new_ids: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "new_ids", token_array(self.new_ids, "delta.new_ids"))
        if self.shared_prefix_len < 0:
            raise ValueError(f"delta.shared_prefix_len is {self.shared_prefix_len}; it must be >= 0")
        if not self.base_call_id and self.shared_prefix_len:
            raise ValueError("delta.shared_prefix_len must be 0 when delta.base_call_id is empty")


@dataclass(frozen=True)
class TitoCall:
    """One model call exactly as the engine saw it. Invariant: len(output_ids) == len(output_logprobs);
    exactly one of ``prompt_ids`` / ``delta`` is set."""

    execution_id: str
    call_id: str
    agent_id: str
    role: AgentRole
    output_ids: np.ndarray
    output_logprobs: np.ndarray
    weight_version: int
    prompt_ids: np.ndarray | None = None
    delta: PromptDelta | None = None
    job_id: str = ""
    finished_at_s: float = 0.0
    finish_reason: str = ""
    attempt: int = 0  # the execution's lease attempt (0: not given); see CallContext.attempt
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    # Grammar-constrained calls only (services/rollout/grammar.py), per output token: the grammar
    # allowed no other token (bool: context, never trained), and its logprob under the unmasked
    # policy (float32: the rollout logprob the trainer uses; output_logprobs are the masked
    # distribution's, the one it was sampled from). Both or neither.
    output_forced: np.ndarray | None = None
    output_policy_logprobs: np.ndarray | None = None

    def __post_init__(self) -> None:
        where = f"record {self.call_id!r} of execution {self.execution_id!r}"
        if not self.execution_id:
            raise ValueError("record has an empty execution_id")
        if not self.call_id:
            raise ValueError(f"record of execution {self.execution_id!r} has an empty call_id")
        object.__setattr__(self, "role", AgentRole.parse(self.role))
        if (self.prompt_ids is None) == (self.delta is None):
            raise ValueError(f"{where}: set exactly one of prompt_ids and delta")
        out = token_array(self.output_ids, f"{where}: output_ids")
        lp = np.asarray(self.output_logprobs, dtype=np.float32)
        if lp.ndim != 1 or len(lp) != len(out):
            raise ValueError(
                f"{where}: output_logprobs has {lp.size} values but output_ids has {len(out)} tokens; "
                "they must be equally long")
        if lp.size and not (np.isfinite(lp).all() and float(lp.max()) <= LOGPROB_TOLERANCE):
            raise ValueError(f"{where}: output_logprobs must be finite log-probabilities (<= 0)")
        object.__setattr__(self, "output_ids", out)
        object.__setattr__(self, "output_logprobs", lp)
        if (self.output_forced is None) != (self.output_policy_logprobs is None):
            raise ValueError(f"{where}: output_forced and output_policy_logprobs come together (a constrained call)")
        if self.output_forced is not None and self.output_policy_logprobs is not None:
            forced = np.asarray(self.output_forced, dtype=bool)
            policy = np.asarray(self.output_policy_logprobs, dtype=np.float32)
            if forced.shape != out.shape or policy.shape != out.shape:
                raise ValueError(f"{where}: output_forced ({forced.size}) and output_policy_logprobs ({policy.size}) "
                                 f"need one value per output token ({len(out)})")
            if policy.size and not (np.isfinite(policy).all() and float(policy.max()) <= LOGPROB_TOLERANCE):
                raise ValueError(f"{where}: output_policy_logprobs must be finite log-probabilities (<= 0)")
            object.__setattr__(self, "output_forced", forced)
            object.__setattr__(self, "output_policy_logprobs", policy)
        if self.prompt_ids is not None:
            prompt = token_array(self.prompt_ids, f"{where}: prompt_ids")
            if prompt.size == 0:
                raise ValueError(f"{where}: the prompt is empty; a model call conditions on at least one token")
            object.__setattr__(self, "prompt_ids", prompt)
        elif self.delta is not None and self.delta.shared_prefix_len + len(self.delta.new_ids) == 0:
            raise ValueError(f"{where}: the prompt is empty; a model call conditions on at least one token")
        if self.weight_version < 0:
            raise ValueError(f"{where}: weight_version is {self.weight_version}; it must be >= 0")

    @property
    def constrained(self) -> bool:
        return self.output_forced is not None

    @property
    def train_logprobs(self) -> np.ndarray:
        """The rollout logprob of each output token as the trainer uses it (the unmasked policy's)."""
        return self.output_logprobs if self.output_policy_logprobs is None else self.output_policy_logprobs

    @property
    def chosen(self) -> np.ndarray:
        """bool per output token: the model chose it (not forced by a grammar)."""
        return np.ones(len(self.output_ids), bool) if self.output_forced is None else ~self.output_forced

    @property
    def prompt_len(self) -> int:
        if self.prompt_ids is not None:
            return len(self.prompt_ids)
        assert self.delta is not None
        return self.delta.shared_prefix_len + len(self.delta.new_ids)

    @property
    def stored_tokens(self) -> int:
        """Tokens this record carries (new prompt tokens + output)."""
        head = self.prompt_ids if self.prompt_ids is not None else self.delta.new_ids  # type: ignore[union-attr]
        return len(head) + len(self.output_ids)


@dataclass(frozen=True)
class Outcome:
    """End of an execution as the trajectory service needs it (mirrors gyre.v1.ExecutionOutcome)."""

    execution_id: str
    group_id: str
    status: Status
    reward: float | None
    excluded: bool = False
    step: int = 0
    job_id: str = ""

    def __post_init__(self) -> None:
        if not self.execution_id:
            raise ValueError("execution outcome has an empty execution_id")
        object.__setattr__(self, "status", Status.parse(self.status))
        if self.reward is not None and not math.isfinite(self.reward):
            raise ValueError(f"execution {self.execution_id!r}: reward {self.reward!r} is not a finite number")
        if self.step < 0:
            raise ValueError(f"execution {self.execution_id!r}: step {self.step} must be >= 0")

    @property
    def trained(self) -> bool:
        """Whether this execution contributes to training (has a reward and is not excluded)."""
        return not self.excluded and self.reward is not None


@dataclass(frozen=True)
class IngestSummary:
    """What one ingest call stored (mirrors gyre.v1.IngestSummary)."""

    accepted: int = 0
    duplicates: int = 0
    new_tokens: int = 0
    record_tokens: int = 0
    executions: int = 0


# --------------------------------------------------------------------------- delta encoding
class DeltaEncoder:
    """Per execution, encodes full prompts as deltas against the earlier call sharing the longest prefix.

    Keeps one token trie per execution (4 bytes per unique token plus the arrays' growth slack)
    and, per agent, the last full sequence so the common case -- a prompt that extends the same
    agent's previous call -- is one vectorized compare. Anything else walks the trie from the
    root. Cost per call: O(prompt + output) vectorized compare, never a scan over earlier calls.
    Call ``forget(execution_id)`` when an execution ends. With ``max_tokens`` the tries hold at
    most that many tokens: the least recently used executions are dropped (their later calls go
    out whole, or as the deltas they came as: still exact, only larger). Not thread-safe: one
    encoder per sending thread, or a lock around it.
    """

    def __init__(self, max_tokens: int = 0) -> None:
        self._executions: OrderedDict[str, _EncoderState] = OrderedDict()
        self.max_tokens = max_tokens
        self.tokens = 0  # held in every execution's trie and last sequences
        self._dropped: OrderedDict[str, None] = OrderedDict()  # executions evicted for max_tokens (recent ones)

    def _state(self, execution_id: str) -> _EncoderState:
        state = self._executions.get(execution_id)
        if state is None:
            state = self._executions[execution_id] = _EncoderState()
        self._executions.move_to_end(execution_id)
        return state

    def _grew(self, state: _EncoderState, tokens: int) -> None:
        state.tokens += tokens
        self.tokens += tokens
        while self.max_tokens and self.tokens > self.max_tokens and len(self._executions) > 1:
            oldest = next(iter(self._executions))
            self.forget(oldest)
            self._dropped[oldest] = None
            while len(self._dropped) > 100_000:
                self._dropped.popitem(last=False)

    def executions(self) -> list[str]:
        return list(self._executions)

    def encode(self, execution_id: str, call_id: str, prompt_ids: Any, output_ids: Any,
               agent_id: str = "") -> PromptDelta:
        """The delta form of the call's prompt; records the call as a future base."""
        state = self._state(execution_id)
        if call_id in state.deltas:  # a resend of the same call: same answer
            return state.deltas[call_id]
        prompt = token_array(prompt_ids, "prompt_ids")
        out = token_array(output_ids, "output_ids")
        trie = state.trie
        node, pos = ROOT, 0
        last = state.last_by_agent.get(agent_id)
        if last is not None:
            last_seq, last_end = last
            n = len(last_seq)
            if len(prompt) >= n and np.array_equal(prompt[:n], last_seq):
                node, pos = last_end, n
        node, pos = trie.match(node, prompt, pos)
        if pos == 0:
            delta = PromptDelta("", 0, prompt)
        else:
            delta = PromptDelta(state.call_ids[trie.owner(node)], pos, prompt[pos:])
        full = np.concatenate((prompt, out))
        end, _ = trie.insert(node, full[pos:], owner=len(state.call_ids))
        state.call_ids.append(call_id)
        state.deltas[call_id] = delta
        state.end_nodes[call_id] = end
        state.last_by_agent[agent_id] = (full, end)
        self._grew(state, 2 * (len(full) - pos))  # the trie's new nodes + the agent's last sequence
        return delta

    def encode_call(self, call: TitoCall) -> TitoCall:
        """``call`` with its full prompt replaced by a delta (delta calls are recorded as they are).
        A call of a later lease attempt starts the execution over: no delta against an earlier
        attempt's calls (the trajectory service drops those)."""
        state = self._executions.get(call.execution_id)
        if state is not None and call.attempt and call.attempt != state.attempt:
            self.forget(call.execution_id)
        if call.attempt:
            self._state(call.execution_id).attempt = call.attempt
        if call.prompt_ids is None:
            self._record_delta_call(call)
            return call
        delta = self.encode(call.execution_id, call.call_id, call.prompt_ids, call.output_ids, call.agent_id)
        return replace(call, prompt_ids=None, delta=delta)

    def _record_delta_call(self, call: TitoCall) -> None:
        """Track an already delta-encoded call so later full prompts can use it as a base."""
        assert call.delta is not None
        state = self._state(call.execution_id)
        if call.call_id in state.deltas:
            return
        d = call.delta
        node = ROOT
        if d.base_call_id:
            if d.base_call_id not in state.end_nodes:
                if call.execution_id in self._dropped:  # its base was dropped (max_tokens): pass it on untracked
                    return
                raise ValueError(f"call {call.call_id!r}: base call {d.base_call_id!r} was not seen by this encoder")
            base_end = state.end_nodes[d.base_call_id]
            if d.shared_prefix_len > state.trie.depth(base_end) + 1:
                raise ValueError(f"call {call.call_id!r}: delta.shared_prefix_len {d.shared_prefix_len} exceeds the "
                                 f"length of base call {d.base_call_id!r}")
            node = state.trie.ancestor(base_end, d.shared_prefix_len - 1)
        seq = np.concatenate((d.new_ids, call.output_ids))
        end, _ = state.trie.insert(node, seq, owner=len(state.call_ids))
        state.call_ids.append(call.call_id)
        state.deltas[call.call_id] = d
        state.end_nodes[call.call_id] = end
        state.last_by_agent.pop(call.agent_id, None)
        self._grew(state, len(seq))

    def forget(self, execution_id: str) -> None:
        state = self._executions.pop(execution_id, None)
        if state is not None:
            self.tokens -= state.tokens

    def __contains__(self, execution_id: str) -> bool:
        return execution_id in self._executions


@dataclass
class _EncoderState:
    trie: TokenTrie = field(default_factory=TokenTrie)
    call_ids: list[str] = field(default_factory=list)
    deltas: dict[str, PromptDelta] = field(default_factory=dict)
    end_nodes: dict[str, int] = field(default_factory=dict)
    last_by_agent: dict[str, tuple[np.ndarray, int]] = field(default_factory=dict)
    attempt: int = 0  # lease attempt of the calls seen (0: not given)
    tokens: int = 0


# --------------------------------------------------------------------------- JSONL
@dataclass(frozen=True)
class JsonlExecution:
    """Per-execution fields from a JSONL file (any of them may be missing)."""

    execution_id: str
    group_id: str = ""
    status: Status | None = None
    reward: float | None = None


def parse_call(obj: dict[str, Any], *, where: str = "record") -> TitoCall:
    """A ``TitoCall`` from one JSON object (lenient defaults: role main, agent = role, version 0,
    zero log-probs when ``output_logprobs`` is absent)."""
    try:
        output = obj.get("output_ids", [])
        logprobs = obj.get("output_logprobs")
        if logprobs is None:
            logprobs = np.zeros(len(output), dtype=np.float32)
        delta = None
        if "delta" in obj and obj["delta"] is not None:
            d = obj["delta"]
            delta = PromptDelta(str(d.get("base_call_id", "")), int(d.get("shared_prefix_len", 0)),
                                d.get("new_ids", []))
        prompt = obj.get("prompt_ids") if delta is None else None
        if delta is None and prompt is None:
            raise ValueError("it has neither prompt_ids nor delta")
        role = AgentRole.parse(obj.get("role", "main"))
        return TitoCall(
            execution_id=str(obj.get("execution_id", "")),
            call_id=str(obj.get("call_id", "")),
            agent_id=str(obj.get("agent_id", role.name.lower())),
            role=role,
            prompt_ids=prompt,
            delta=delta,
            output_ids=output,
            output_logprobs=logprobs,
            weight_version=int(obj.get("weight_version", 0)),
            job_id=str(obj.get("job_id", "")),
            finished_at_s=float(obj.get("finished_at_s", 0.0)),
            finish_reason=str(obj.get("finish_reason", "")),
            output_forced=obj.get("output_forced"),
            output_policy_logprobs=obj.get("output_policy_logprobs"),
        )
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def read_jsonl(lines: Iterable[str]) -> tuple[list[TitoCall], dict[str, JsonlExecution]]:
    """Calls (file order) and per-execution fields (in order of first appearance) from JSONL lines.

    A line is a call when it has ``call_id``, ``prompt_ids``, ``delta`` or ``output_ids``; otherwise
    it describes an execution. A ``reward`` on a call line is the execution's reward (the last wins).
    Raises ValueError naming the line number on malformed input.
    """
    calls: list[TitoCall] = []
    executions: dict[str, JsonlExecution] = {}
    for lineno, line in enumerate(lines, start=1):
        line = line.strip()
        if not line:
            continue
        where = f"line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not obj.get("execution_id"):
            raise ValueError(f"{where}: expected a JSON object with a non-empty execution_id")
        eid = str(obj["execution_id"])
        prev = executions.get(eid, JsonlExecution(eid))
        is_call = any(k in obj for k in ("call_id", "prompt_ids", "delta", "output_ids"))
        if is_call:
            if "call_id" not in obj:
                obj = {**obj, "call_id": f"line-{lineno}"}
            calls.append(parse_call(obj, where=where))
        try:
            group = str(obj.get("group_id", prev.group_id) or prev.group_id)
            status = Status.parse(obj["status"]) if obj.get("status") is not None else prev.status
            reward = prev.reward
            if obj.get("reward") is not None:
                reward = float(obj["reward"])
                if not math.isfinite(reward):
                    raise ValueError(f"reward {obj['reward']!r} is not a finite number")
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        executions[eid] = JsonlExecution(eid, group, status, reward)
    return calls, executions


def read_jsonl_file(path: str | Path) -> tuple[list[TitoCall], dict[str, JsonlExecution]]:
    try:
        with open(path, encoding="utf-8") as fh:
            return read_jsonl(fh)
    except FileNotFoundError:
        raise ValueError(f"records file {str(path)!r} does not exist") from None


def call_to_json(call: TitoCall) -> dict[str, Any]:
    """The JSONL object of a call (inverse of ``parse_call``)."""
    obj: dict[str, Any] = {
        "execution_id": call.execution_id,
        "call_id": call.call_id,
        "agent_id": call.agent_id,
        "role": call.role.name.lower(),
        "output_ids": call.output_ids.tolist(),
        "output_logprobs": [float(x) for x in call.output_logprobs],
        "weight_version": call.weight_version,
    }
    if call.job_id:
        obj["job_id"] = call.job_id
    if call.output_forced is not None and call.output_policy_logprobs is not None:
        obj["output_forced"] = call.output_forced.tolist()
        obj["output_policy_logprobs"] = [float(x) for x in call.output_policy_logprobs]
    if call.prompt_ids is not None:
        obj["prompt_ids"] = call.prompt_ids.tolist()
    else:
        assert call.delta is not None
        obj["delta"] = {"base_call_id": call.delta.base_call_id,
                        "shared_prefix_len": call.delta.shared_prefix_len,
                        "new_ids": call.delta.new_ids.tolist()}
    return obj


def iter_executions(calls: Iterable[TitoCall]) -> Iterator[tuple[str, list[TitoCall]]]:
    """Calls grouped by execution id, executions in order of first appearance, calls in record order."""
    grouped: dict[str, list[TitoCall]] = {}
    for c in calls:
        grouped.setdefault(c.execution_id, []).append(c)
    yield from grouped.items()

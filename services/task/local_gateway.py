"""The gateway's OpenAI-compatible request logic in process, over a `ModelClient` instead of engines.

A third-party agent loop (smolagents, openai-agents) can run against it with no stack: its requests
are rendered with the model's chat template, constrained (a forced tool call's opening), shaped
into ``tool_calls`` and remembered across turns exactly as the gateway's HTTP endpoint does, and
sampled under the request's grammar as an engine samples (a forced call's arguments valid against
its tool's schema; a `ModelClient` that cannot mask, like the scripted demonstrator, ignores it),
because it *is* that code (services.rollout.gateway, services.rollout.openai_http); only the
engine underneath is a `ModelClient` (the scripted tool demonstrator, or a model in process).
That is how the tool model's warm start records demonstrations in a loop's own dialect
(services.task.tool_demos): the prompts are the ones the loop will send through the real gateway.

    loop (its own client code) ──chat.completions.create(**body)──> LocalOpenAI
        ──> OpenAIEndpoint.chat(body) ──> Gateway ──> _ClientConn ──> ModelClient.generate
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import numpy as np

from services.rollout.calls import CallMeta, Piece
from services.rollout.engine import SamplingParams
from services.rollout.grammar import Constraint, GrammarBook
from services.task.agent import CallContext, ModelClient, Sampling

__all__ = ["LocalOpenAI"]

_ADDRESS = "in-process:0"  # the router wants host:port; nothing listens or connects


class _Source:
    """A finished generation as the engine stream the gateway reads (all tokens, then the end)."""

    def __init__(self, pieces: list[Piece]) -> None:
        self._pieces = pieces

    def __iter__(self) -> Any:
        return iter(self._pieces)

    def cancel(self) -> None:
        pass


class _ClientConn:
    """The gateway's `EngineConn` over a `ModelClient`: one engine that never moves a request."""

    address = _ADDRESS

    def __init__(self, client: ModelClient, *, vocab_size: int, max_context: int, model_name: str,
                 timeout_s: float, grammars: GrammarBook | None = None) -> None:
        self.client, self.timeout_s, self.grammars = client, timeout_s, grammars
        self.load = SimpleNamespace(cell_id="local", active=0, kv_tokens=0, capacity_tokens=1 << 40,
                                    weight_version=0, vocab_size=vocab_size, max_context=max_context,
                                    model_name=model_name, draining=False, request_ids=[])

    def generate_stream(self, request_id: str, meta: CallMeta, prompt_ids: np.ndarray,
                        params: SamplingParams) -> _Source:
        gen = self.client.generate(
            CallContext(job_id=meta.job_id, execution_id=meta.execution_id, call_id=meta.call_id,
                        agent_id=meta.agent_id, role=meta.role or "main"),  # type: ignore[arg-type]
            np.asarray(prompt_ids, dtype=np.int32),
            Sampling(temperature=params.temperature, max_new_tokens=params.max_new_tokens,
                     stop_token_ids=tuple(params.stop_token_ids), top_p=params.top_p, top_k=params.top_k,
                     seed=params.seed, constraint=self._constraint(params)),
            timeout_s=self.timeout_s)
        ids = np.asarray(gen.output_ids, dtype=np.int32)
        lps = np.asarray(gen.logprobs, dtype=np.float32)
        return _Source([Piece(request_id, ids, lps, 0, weight_version=gen.weight_version),
                        Piece(request_id, ids[:0], lps[:0], len(ids), finished=True,
                              finish_reason=gen.finish_reason or "stop", weight_version=gen.weight_version)])

    def _constraint(self, params: SamplingParams) -> Constraint | None:
        """The request's grammar as a fresh matcher (a forced call's arguments, response_format),
        as an engine applies it; None without a grammar or a book."""
        if params.grammar is None or self.grammars is None:
            return None
        return self.grammars.constraint(params.grammar, params.stop_token_ids)

    def resume_stream(self, *args: Any, **kwargs: Any) -> _Source:
        raise NotImplementedError("an in-process model is never lost mid-call")

    def attach(self, request_id: str, wait_s: float) -> _Source:
        raise NotImplementedError("an in-process model never migrates a request")

    def migrate_out(self, request_ids: list[str], target_address: str, transport: str) -> list[Any]:
        return []

    def get_load(self, timeout_s: float | None = None) -> Any:
        return self.load

    def drain(self, wait_s: float, *, cancel: bool = False) -> int:
        return 0

    def close(self) -> None:
        pass


class _Completions:
    def __init__(self, owner: LocalOpenAI) -> None:
        self._owner = owner

    def create(self, **body: Any) -> Any:
        """``client.chat.completions.create``: the body goes through the gateway's endpoint as if it
        had come over HTTP; the answer is the `openai` SDK's own response type."""
        from openai.types.chat import ChatCompletion

        if body.get("stream"):
            raise ValueError("the in-process endpoint answers whole responses only (stream=False)")
        extra = body.pop("extra_body", None) or {}
        result, _ = self._owner.endpoint.chat({**body, **extra}, self._owner.headers)
        assert result is not None
        return ChatCompletion.model_validate(result)


class LocalOpenAI:
    """An `openai.OpenAI` stand-in for ``chat.completions.create`` whose server is the gateway's
    endpoint code in this process, over ``client``. ``headers`` are sent with every request
    (``x-gyre-execution-id``: the calls' execution); the ids of the tool calls in its replies
    are drawn from ``seed``. ``close()`` stops the gateway."""

    def __init__(self, client: ModelClient, *, tokenizer: Any, model_name: str, max_context: int,
                 headers: dict[str, str] | None = None, timeout_s: float = 600.0, seed: int = 0,
                 constrain: bool = True) -> None:
        from services.rollout.gateway import Gateway
        from services.rollout.openai_http import OpenAIEndpoint
        from services.rollout.router import Router

        # the engine's grammars (a forced call's arguments, response_format) over the same vocabulary
        grammars = GrammarBook(tokenizer, len(tokenizer)) if constrain else None
        conn = _ClientConn(client, vocab_size=len(tokenizer), max_context=max_context, model_name=model_name,
                           timeout_s=timeout_s, grammars=grammars)
        self.gateway = Gateway(connect=lambda address: conn, router=Router(), probe_interval_s=3600.0)
        self.gateway.register_engine("local", _ADDRESS)
        ids = random.Random(seed)  # the replies' tool-call ids: a function of the seed (the prompts carry them)
        self.endpoint = OpenAIEndpoint(self.gateway, tokenizer=tokenizer, model_name=model_name,
                                       new_call_id=lambda: f"call_{ids.getrandbits(96):024x}")
        self.headers = dict(headers or {})
        self.chat = SimpleNamespace(completions=_Completions(self))

    def close(self) -> None:
        self.gateway.stop()

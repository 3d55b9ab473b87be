"""``InferenceEngine`` adapter for an sglang server (GPU hosts), over sglang's native HTTP API.

UNVERIFIED HERE: sglang needs CUDA builds that cannot be installed in this project's environment,
so only the request/response mapping (the pure functions below) is unit-tested; the HTTP calls
follow sglang's documented endpoints and have not run against a live server.

Mapping::

    submit            POST /generate  {input_ids, sampling_params, return_logprob, stream, rid}
                      SSE "data: {...}" chunks -> TokenEvents (tokens past those already seen)
    cancel            POST /abort_request {rid}
    update_weights    save safetensors to weights_dir/v<version>, then
                      POST /pause_generation {mode} -> POST /update_weights_from_disk
                      {model_path, weight_version, flush_cache} -> POST /continue_generation
    reprefill/import  /generate with input_ids = prompt + generated (sglang cannot import KV:
                      a migration into sglang re-prefills; sglang_seed continues the counter)
    export_request    unsupported (sglang exposes no KV export) -> FailedPrecondition

Weight policy: ``recompute`` pauses with ``mode="retract"`` (running requests go back to the
queue and recompute their KV under the new weights); ``finish_on_old`` stops admitting, waits for
this adapter's in-flight requests to finish, then updates.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.request
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from services.common.errors import FailedPrecondition
from services.common.logging import get_logger
from services.rollout.engine import EventCallback, GenRequest, InferenceEngine, MigrationState, TokenEvent

if TYPE_CHECKING:
    import torch

log = get_logger(__name__)

_FINISH = {"stop": "stop", "length": "length", "abort": "aborted"}


# --------------------------------------------------------------------------- pure mapping
def generate_payload(req: GenRequest, generated_ids: np.ndarray | None = None, *, stream: bool = True) -> dict:
    """The /generate body for a request (``generated_ids``: resume after those tokens)."""
    p = req.params
    ids = req.prompt_ids if generated_ids is None else np.concatenate([req.prompt_ids, generated_ids])
    done = 0 if generated_ids is None else len(generated_ids)
    sampling: dict[str, Any] = {
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1,  # sglang: -1 disables top-k
        "max_new_tokens": p.max_new_tokens - done,
        "stop_token_ids": list(p.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,  # keep the stop token in output_ids (TITO records what was sampled)
    }
    if p.seed is not None:
        sampling["sampling_seed"] = p.seed
    if p.grammar is not None:
        # sglang's own grammar backend (xgrammar) enforces it; it reports no forced flags or
        # unmasked logprobs, so such calls are recorded as free choices with the masked logprobs
        if done:
            raise ValueError("the sglang adapter cannot resume a grammar-constrained request mid-output; "
                             "it restarts the grammar at its prompt")
        key = {"json_schema": "json_schema", "json_object": "json_schema", "regex": "regex", "ebnf": "ebnf"}
        sampling[key[p.grammar.kind]] = p.grammar.source or '{"type": "object"}'
    return {"input_ids": ids.tolist(), "sampling_params": sampling, "return_logprob": True,
            "stream": stream, "rid": req.request_id}


def parse_chunk(chunk: Mapping[str, Any], seen: int) -> tuple[np.ndarray, np.ndarray, str | None, int | None]:
    """New tokens in one /generate response or stream chunk, given ``seen`` tokens already taken.

    Returns (token_ids, logprobs, finish_reason | None, weight_version | None). sglang streams
    either cumulative or incremental outputs (``incremental_streaming_output``); a chunk whose
    ``output_ids`` hold ``completion_tokens`` ids is cumulative and is cut at ``seen``.
    """
    meta = chunk.get("meta_info", {})
    ids = list(chunk.get("output_ids", []))
    lps = [float(x[0]) if x[0] is not None else 0.0 for x in meta.get("output_token_logprobs", [])]
    total = int(meta.get("completion_tokens", len(ids)))
    if len(ids) == total and total >= seen:
        ids = ids[seen:]
    if len(lps) == total and total >= seen:
        lps = lps[seen:]
    if len(lps) != len(ids):
        raise ValueError(f"sglang chunk has {len(ids)} new ids but {len(lps)} logprobs")
    fr = meta.get("finish_reason")
    reason = None
    if isinstance(fr, Mapping):
        reason = _FINISH.get(str(fr.get("type")), "error")
    elif isinstance(fr, str):
        reason = _FINISH.get(fr, "error")
    wv = meta.get("weight_version")
    version = int(wv) if wv not in (None, "", "default") and str(wv).lstrip("-").isdigit() else None
    return np.asarray(ids, np.int32), np.asarray(lps, np.float32), reason, version


def iter_sse(lines: Iterator[bytes]) -> Iterator[dict[str, Any]]:
    """JSON objects of an sglang SSE stream (``data: {...}`` lines, ends at ``data: [DONE]``)."""
    for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


# --------------------------------------------------------------------------- adapter
class SGLangEngine(InferenceEngine):
    """Thin adapter: one HTTP stream (and thread) per request. UNVERIFIED against a live server."""

    def __init__(self, base_url: str, *, model_name: str, vocab_size: int, max_context: int,
                 weights_dir: str = "", base_model_path: str = "", weight_policy: str = "recompute",
                 weight_version: int = 0, timeout_s: float = 3600.0) -> None:
        if weight_policy not in ("recompute", "finish_on_old"):
            raise ValueError(f"weight_policy must be 'recompute' or 'finish_on_old', got {weight_policy!r}")
        self.base_url = base_url.rstrip("/")
        self.model_name, self.vocab_size, self.max_context = model_name, vocab_size, max_context
        self.weights_dir, self.base_model_path = weights_dir, base_model_path
        self.weight_policy, self.weight_version, self.timeout_s = weight_policy, weight_version, timeout_s
        self._lock = threading.Condition()
        self._active: dict[str, threading.Thread] = {}
        self._admitting = True

    def _post(self, path: str, body: Mapping[str, Any]) -> Any:
        data = json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def start(self) -> None:
        urllib.request.urlopen(self.base_url + "/health", timeout=30).close()

    def stop(self, drain: bool = False) -> None:
        with self._lock:
            self._admitting = False
            ids = list(self._active)
        for rid in [] if drain else ids:
            self.cancel(rid)
        for t in list(self._active.values()):
            t.join(timeout=self.timeout_s)

    def submit(self, req: GenRequest, on_event: EventCallback) -> None:
        self._start(req, None, on_event)

    def _start(self, req: GenRequest, generated: np.ndarray | None, on_event: EventCallback) -> None:
        ids = req.prompt_ids
        if ids.size == 0:
            raise ValueError("prompt_ids is empty: a prompt needs at least one token")
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"prompt_ids has ids outside the vocabulary [0, {self.vocab_size})")
        if len(ids) + (0 if generated is None else len(generated)) >= self.max_context:
            raise ValueError(f"prompt does not fit the model's context of {self.max_context} tokens")
        with self._lock:
            if not self._admitting:
                raise FailedPrecondition("engine is not admitting requests (stopping or updating weights)")
            if req.request_id in self._active:
                raise ValueError(f"request id {req.request_id!r} is already active on this engine")
            t = threading.Thread(target=self._stream, args=(req, generated, on_event), daemon=True)
            self._active[req.request_id] = t
        t.start()

    def _stream(self, req: GenRequest, generated: np.ndarray | None, on_event: EventCallback) -> None:
        offset = 0 if generated is None else len(generated)
        seen, reason = 0, None
        try:
            body = json.dumps(generate_payload(req, generated)).encode()
            request = urllib.request.Request(self.base_url + "/generate", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                for chunk in iter_sse(iter(resp.readline, b"")):
                    ids, lps, reason, version = parse_chunk(chunk, seen)
                    seen += len(ids)
                    if len(ids) or reason:
                        on_event(TokenEvent(req.request_id, ids, lps, reason is not None, reason,
                                            version if version is not None else self.weight_version,
                                            offset=offset + seen - len(ids), seed=req.params.seed or 0))
        except Exception as exc:  # deliberate: the stream ends with "error", the engine goes on
            log.warning("sglang stream failed", request_id=req.request_id, error=str(exc))
            reason = None
        finally:
            if reason is None:
                on_event(TokenEvent(req.request_id, np.zeros(0, np.int32), np.zeros(0, np.float32), True, "error",
                                    self.weight_version, offset=offset + seen, seed=req.params.seed or 0))
            with self._lock:
                self._active.pop(req.request_id, None)
                self._lock.notify_all()

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            if request_id not in self._active:
                return False
        self._post("/abort_request", {"rid": request_id})
        return True

    def export_request(self, request_id: str) -> MigrationState:
        raise FailedPrecondition("the sglang engine cannot export KV; migrate its requests by re-prefill")

    def import_request(self, state: MigrationState, on_event: EventCallback) -> None:
        # sglang cannot take foreign KV: recompute it (the caller's state.kv is dropped)
        self.reprefill_request(state.request, state.generated_ids, state.generated_logprobs, state.rng_state,
                               state.weight_version, on_event)

    def reprefill_request(self, req: GenRequest, generated_ids: np.ndarray, generated_logprobs: np.ndarray,
                          rng_state: bytes | None, weight_version: int, on_event: EventCallback) -> None:
        self._start(req, np.asarray(generated_ids, np.int32), on_event)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, *, restart: bool = False) -> None:
        if version <= self.weight_version and not restart:
            raise ValueError(f"weight version {version} is not newer than {self.weight_version}")
        if not self.weights_dir:
            raise FailedPrecondition("sglang weight updates need weights_dir (a path the server can read)")
        from safetensors.torch import save_file

        path = os.path.join(self.weights_dir, f"v{version}")
        os.makedirs(path, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()},
                  os.path.join(path, "model.safetensors"))
        for name in ("config.json", "generation_config.json"):
            src = os.path.join(self.base_model_path, name)
            if self.base_model_path and os.path.exists(src):
                with open(src, "rb") as f, open(os.path.join(path, name), "wb") as g:
                    g.write(f.read())
        if self.weight_policy == "finish_on_old":
            with self._lock:
                self._admitting = False
                while self._active:
                    self._lock.wait()
        else:
            self._post("/pause_generation", {"mode": "retract"})
        try:
            reply = self._post("/update_weights_from_disk", {"model_path": path, "weight_version": str(version),
                                                             "flush_cache": True})
            if not reply or not reply.get("success", False):
                raise FailedPrecondition(f"sglang refused the weights: {reply}")
            self.weight_version = version
        finally:
            if self.weight_policy == "finish_on_old":
                with self._lock:
                    self._admitting = True
            else:
                self._post("/continue_generation", {})

    def active_requests(self) -> list[str]:
        with self._lock:
            return list(self._active)

    def load(self) -> dict[str, int]:
        return {"active": len(self.active_requests()), "kv_tokens": 0, "capacity_tokens": 0}

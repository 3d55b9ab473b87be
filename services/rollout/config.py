"""Configs of the two rollout processes: ``EngineConfig`` (gyre-engine, one ROLLOUT cell) and
``GatewayConfig`` (gyre-gateway). Sections ``[engine]`` / ``[gateway]`` of the TOML config, env
``GYRE_ENGINE_<FIELD>`` / ``GYRE_GATEWAY_<FIELD>``, or ``--field value`` flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.config import ServerConfig, check, setting

KV_KINDS = ("ucx", "tcp")
HTTP_SERVERS = ("async", "threads")


@dataclass(frozen=True, kw_only=True)
class EngineConfig(ServerConfig):
    """A ROLLOUT cell hosting a ``TorchEngine``."""

    max_workers: int = setting(1024, "Threads serving RPCs: one per concurrent stream (>= max_batch_size).")
    cell_id: str = setting("cell-0", "Id of the cell this engine serves (the scheduler's cell id).")
    model: str = setting("builtin-tiny", "Local checkpoint directory or a name services.models.source resolves "
                                         "('builtin-tiny', 'smollm2-135m-instruct'), or 'random-tiny' (random init).")
    model_cache_dir: str = setting("", "Where named models are built/converted; empty = the shared default "
                                       "(.gyre/models or $GYRE_MODEL_CACHE).")
    device: str = setting("auto", "cpu, cuda, cuda:N or auto (cuda when available).")
    dtype: str = setting("auto", "Weights dtype: auto (bf16 on cuda, fp32 on cpu), float32, bfloat16, float16.")
    max_batch_size: int = setting(64, "Requests decoded together in one engine step.")
    max_context_tokens: int = setting(0, "Longest prompt + output, tokens; 0 = the model's own limit.")
    kv_capacity_tokens: int = setting(0, "KV budget of running requests, tokens (at least one full context); "
                                         "0 = 64K tokens, or one full context when that is longer.")
    prefix_cache_mb: int = setting(-1, "KV of finished calls kept for the next call that starts with them, MiB "
                                       "(at least one full context's KV); 0 turns prefix reuse off; -1 = 512 MiB "
                                       "or one full context's KV, whichever is more.")
    prefill_chunk_tokens: int = setting(4096, "Prompt tokens prefilled per engine step and request.")
    weight_policy: str = setting("recompute", "On a weight update: 'recompute' in-flight KV under the new "
                                              "version, or 'finish_on_old' (update waits for them).")
    torch_threads: int = setting(0, "torch intra-op threads; 0 = torch's default.")
    cuda_graphs: bool = setting(True, "On a CUDA device, replay each decode step from a captured CUDA graph "
                                      "(batch padded to 1, 2, 4, 8, then steps of 8); false = eager decode. "
                                      "No effect on CPU.")
    kv_transports: tuple[str, ...] = setting(KV_KINDS, "KV receivers offered for incoming migrations, "
                                                       "in preference order (ucx, tcp).")
    attach_wait_s: float = setting(30.0, "How long Attach waits for a migrating request to arrive, seconds.")
    gateway_address: str = setting("", "Gateway to register with at start (and leave at stop); empty = none.")
    advertise_host: str = setting("", "Host other processes reach this engine by; empty = host.")
    kv_receive_pool_mb: int = setting(512, "Idle receive memory kept for incoming migrations, MiB (states land in "
                                           "already-mapped pages: ~2x the UCX bandwidth); 0 = fresh memory each time.")
    kv_auth_key_file: str = setting("", "File holding the deployment's KV migration key (every engine the same): "
                                        "migration headers are signed with it and unsigned ones refused; empty = "
                                        "unauthenticated (local runs).")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(bool(self.cell_id), "cell_id", self.cell_id, "a non-empty cell id")
        check(self.kv_receive_pool_mb >= 0, "kv_receive_pool_mb", self.kv_receive_pool_mb, "MiB >= 0")
        if self.kv_auth_key_file:
            try:
                key = self.kv_key
            except OSError as exc:
                raise ValueError(f"config field 'kv_auth_key_file' is {self.kv_auth_key_file!r}: {exc}") from None
            check(len(key) >= 16, "kv_auth_key_file", self.kv_auth_key_file, "a file with a key of >= 16 bytes")
        check(bool(self.model), "model", self.model, "a checkpoint directory, 'builtin-tiny' or 'random-tiny'")
        check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", self.dtype,
              "auto, float32, bfloat16 or float16")
        check(self.max_batch_size >= 1, "max_batch_size", self.max_batch_size, "at least 1")
        check(self.max_context_tokens == 0 or self.max_context_tokens >= 2, "max_context_tokens",
              self.max_context_tokens, "0 or at least 2")
        check(self.kv_capacity_tokens >= 0, "kv_capacity_tokens", self.kv_capacity_tokens, ">= 0")
        check(self.prefix_cache_mb >= -1, "prefix_cache_mb", self.prefix_cache_mb, "MiB >= 0, or -1 (automatic)")
        check(self.prefill_chunk_tokens >= 1, "prefill_chunk_tokens", self.prefill_chunk_tokens, "at least 1")
        check(self.weight_policy in ("recompute", "finish_on_old"), "weight_policy", self.weight_policy,
              "'recompute' or 'finish_on_old'")
        check(self.torch_threads >= 0, "torch_threads", self.torch_threads, ">= 0")
        check(bool(self.kv_transports) and all(k in KV_KINDS for k in self.kv_transports), "kv_transports",
              self.kv_transports, "a non-empty list of ucx / tcp")
        check(self.attach_wait_s > 0, "attach_wait_s", self.attach_wait_s, "> 0 seconds")
        check(self.max_workers >= self.max_batch_size, "max_workers", self.max_workers,
              f"at least max_batch_size ({self.max_batch_size}): every running request holds a stream")

    @property
    def kv_key(self) -> bytes:
        return read_key(self.kv_auth_key_file)


def read_key(path: str) -> bytes:
    """A secret key from a file (surrounding whitespace stripped); b"" for no file."""
    return Path(path).read_bytes().strip() if path else b""


@dataclass(frozen=True, kw_only=True)
class GatewayConfig(ServerConfig):
    """The rollout gateway: gRPC TITO + OpenAI-compatible HTTP, routing, migration, TITO forwarding."""

    max_workers: int = setting(1024, "Threads serving RPCs: one per concurrent call stream.")
    engine_addresses: tuple[str, ...] = setting((), "Engines to register at start: 'host:port' (cell id "
                                                    "asked from the engine) or 'cell_id=host:port'.")
    http_port: int = setting(-1, "OpenAI-compatible HTTP port; -1 = off, 0 = any free port.")
    http_host: str = setting("127.0.0.1", "Interface the HTTP endpoint binds.")
    http_max_body_mb: int = setting(64, "Largest HTTP request body, MiB (413 beyond).")
    http_idle_timeout_s: float = setting(60.0, "An HTTP connection idle (or sending its request) this long is closed.")
    http_max_connections: int = setting(4096, "HTTP connections served at once; more are answered 503 and closed.")
    http_server: str = setting("async", "HTTP server: 'async' (one asyncio loop, aiohttp: an idle or streaming "
                                        "connection holds no thread) or 'threads' (a thread per connection; the "
                                        "earlier server, kept as the fallback).")
    http_workers: int = setting(1024, "Threads of the async HTTP server running endpoint calls: a call, or a "
                                      "stream's wait for its next chunk, holds one; more wait their turn.")
    http_advertise_url: str = setting("", "Base URL harnesses reach the HTTP endpoint at (sessions' base URLs "
                                          "extend it); empty = http://<this host towards Redis>:<port>/v1.")
    tokenizer_path: str = setting("", "HF tokenizer (with a chat template) for HTTP: a checkpoint directory or "
                                      "a model name ('builtin-tiny', 'smollm2-135m-instruct').")
    model_cache_dir: str = setting("", "Where named models are built/converted; empty = the shared default.")
    served_model_name: str = setting("gyre", "Model name the HTTP endpoint serves (/v1/models).")
    tool_parser: str = setting("auto", "How tool calls look in generated text: hermes (<tool_call>{json}</tool_call>), "
                                       "llama3_json, or auto (by the chat template).")
    default_max_tokens: int = setting(256, "max_tokens of HTTP calls that do not set it.")
    trajectory_address: str = setting("", "Trajectory service receiving TITO records; empty = not forwarded.")
    job_id: str = setting("", "Job id stamped on TITO records of calls that carry none.")
    sticky_slack: int = setting(4, "Calls an agent's engine may be busier than the least loaded before moving.")
    attach_wait_s: float = setting(30.0, "How long a migrated stream waits to re-attach on its target, seconds.")
    max_recoveries: int = setting(3, "Engine losses one call survives (re-prefill each time) before failing.")
    probe_interval_s: float = setting(2.0, "Engine load/health probe period, seconds.")
    call_cache_tokens: int = setting(16_000_000, "Tokens of recent calls kept for prompt deltas.")
    prompt_cache_tokens: int = setting(8_000_000, "Tokens of recent HTTP conversations kept for exact-id reuse.")
    tito_queue_mb: int = setting(256, "MiB of TITO records buffered for the trajectory service before dropping.")
    tito_encoder_tokens: int = setting(32_000_000, "Tokens the TITO delta encoder keeps (least recently used "
                                                   "executions beyond are dropped: their calls go out whole).")
    tito_forget_interval_s: float = setting(10.0, "How often executions the scheduler ended are dropped from the "
                                                  "delta encoder, seconds.")
    tito_sync_timeout_s: float = setting(10.0, "A call's response waits this long for its TITO record to reach "
                                         "trajectory (so outcomes never overtake records); 0 = fully async.")

    def __post_init__(self) -> None:
        super().__post_init__()
        for a in self.engine_addresses:
            check(":" in a.split("=", 1)[-1], "engine_addresses", a, "'host:port' or 'cell_id=host:port'")
        check(self.tool_parser in ("auto", "hermes", "llama3_json"), "tool_parser", self.tool_parser,
              "auto, hermes or llama3_json")
        check(self.tito_encoder_tokens >= 0, "tito_encoder_tokens", self.tito_encoder_tokens, ">= 0 (0: unbounded)")
        check(self.tito_forget_interval_s > 0, "tito_forget_interval_s", self.tito_forget_interval_s, "> 0 seconds")
        check(self.http_idle_timeout_s > 0, "http_idle_timeout_s", self.http_idle_timeout_s, "> 0 seconds")
        check(self.http_max_connections >= 1, "http_max_connections", self.http_max_connections, ">= 1")
        check(self.http_server in HTTP_SERVERS, "http_server", self.http_server, "async or threads")
        check(self.http_workers >= 1, "http_workers", self.http_workers, ">= 1")
        check(-1 <= self.http_port < 65536, "http_port", self.http_port, "-1, 0 or a port")
        check(self.http_max_body_mb >= 1, "http_max_body_mb", self.http_max_body_mb, "at least 1")
        check(self.default_max_tokens >= 1, "default_max_tokens", self.default_max_tokens, "at least 1")
        check(self.sticky_slack >= 0, "sticky_slack", self.sticky_slack, ">= 0")
        check(self.attach_wait_s > 0, "attach_wait_s", self.attach_wait_s, "> 0 seconds")
        check(self.max_recoveries >= 0, "max_recoveries", self.max_recoveries, ">= 0")
        check(self.probe_interval_s > 0, "probe_interval_s", self.probe_interval_s, "> 0 seconds")
        check(self.call_cache_tokens >= 1, "call_cache_tokens", self.call_cache_tokens, "at least 1")
        check(self.prompt_cache_tokens >= 1, "prompt_cache_tokens", self.prompt_cache_tokens, "at least 1")
        check(self.tito_queue_mb >= 1, "tito_queue_mb", self.tito_queue_mb, "at least 1 MiB")
        check(self.tito_sync_timeout_s >= 0, "tito_sync_timeout_s", self.tito_sync_timeout_s, ">= 0")
        check(not (self.http_port >= 0 and not self.tokenizer_path), "tokenizer_path", self.tokenizer_path,
              "a tokenizer directory (or 'builtin-tiny') when http_port is enabled")

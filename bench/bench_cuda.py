"""The CUDA paths on a GPU host: tree-attention training, the engine's decode graphs and prefix reuse.

    python -m bench.bench_cuda [--out bench/results/cuda.md] [--budget-s 300] [--model qwen3-0.6b]
                               [--sections decode,engine,train]
    python -m bench.bench_cuda --device cpu --model tiny --context 1024 --max-tokens 2048 \
                               --out /tmp/cuda-smoke.md      # smoke run of the script, no GPU

1. **Trainer**: forward + backward of one micro-batch (bf16 autocast over fp32 weights, as the
   trainer's ``dtype = "bfloat16"``) with each attention backend: ``sdpa`` (dense N x N mask),
   ``flex`` (the compiled flex BlockMask kernel, CUDA's default above ``max_dense_tokens``),
   ``blocks`` (block-sparse, any device) and ``chunked`` (a path cut into 8K chunks with exact
   gradients). Packed small trees and single paths from 8K to 128K tokens; tokens/s, peak GPU
   memory, and the first call's time (for flex, its compile: one per distinct batch length).
2. **Engine**: a growing agent context on the CUDA engine (bf16): the time of a call that appends
   1K tokens to a 32K context with the prefix cache, against a full prefill of the same prompt;
   decode tokens/s.
3. **Decode**: greedy decode tokens/s at batch 1 and 8 with the decode forward replayed from CUDA
   graphs against the eager one (bf16, the same engine otherwise), and their ratio. On
   ``--device cpu`` the eager default decode against the static forward that the graphs capture.

Rows run in order of importance until ``--budget-s`` is spent; the table says which were left out.
Random weights of the named model's shapes (no download): speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 8192
DEV = "cuda"  # --device cpu: a smoke run of the script itself on a host without a GPU


def _sync() -> None:
    if DEV.startswith("cuda"):
        torch.cuda.synchronize()

TRAIN_ROWS: list[tuple[str, int, str]] = [  # in order of importance (the budget may end the list)
    ("path", 8192, "sdpa"), ("path", 8192, "flex"), ("path", 8192, "blocks"),
    ("forest", 8192, "sdpa"), ("forest", 8192, "flex"), ("forest", 8192, "blocks"),
    ("path", 65536, "flex"), ("path", 65536, "chunked"),
    ("path", 131072, "flex"), ("path", 131072, "chunked"),
    ("path", 32768, "flex"), ("path", 32768, "blocks"), ("path", 32768, "chunked"),
]


def _batch(kind: str, tokens: int, vocab: int) -> Any:
    from services.trainer.synthetic import make_step
    from services.trainer.tree_forward import TreeTensors

    if kind == "forest":  # executions of ~120 tokens: a trunk and two levels of two branches
        step = make_step(5, num_executions=max(1, tokens // 120), depth=2, branching=2, micro_batch_tokens=1 << 30,
                         vocab=vocab)
        t = TreeTensors.from_batch(step.batches[0], device=DEV)
    else:
        n = tokens
        ids = torch.from_numpy(np.random.default_rng(0).integers(3, vocab, n)).long()
        idx = torch.arange(1, n)
        t = TreeTensors(input_ids=ids, position_ids=torch.arange(n), subtree_end=torch.full((n,), n),
                        target_index=idx, target_parent=idx - 1, target_ids=ids[1:],
                        old_logprobs=torch.zeros(n - 1), advantages=torch.ones(n - 1),
                        loss_weights=torch.full((n - 1,), 1.0 / (n - 1)), weight_version=torch.zeros(n - 1).long())
        t = type(t)(**{k: v.to(DEV) for k, v in t.__dict__.items()})
    return t


def _train_once(policy: Any, t: Any) -> float:
    model = policy.model
    model.zero_grad(set_to_none=True)
    _sync()
    t0 = time.perf_counter()
    with torch.autocast(DEV.split(":")[0], dtype=torch.bfloat16):
        if policy.chunked(t):
            policy.train_chunked(t, lambda lp, _ent, sel: (lp.float() * t.loss_weights[sel]).sum())
        else:
            lp, _ = policy.target_logprobs(t)
            (lp.float() * t.loss_weights).sum().backward()
    _sync()
    return time.perf_counter() - t0


def train_row(model: Any, kind: str, tokens: int, attention: str) -> dict:
    from services.trainer.tree_forward import TreePolicy, disable_layer_checkpointing

    t = _batch(kind, tokens, model.config.vocab_size)
    chunk = CHUNK if attention == "chunked" else 0
    # long batches checkpoint their decoder layers (as the trainer's checkpoint_layers does):
    # without it a 0.6B model keeps ~1 MiB of activations per token
    policy = TreePolicy(model, attention="blocks" if chunk else attention, max_dense_tokens=1 << 30,
                        sparse_block_tokens=256, chunk_tokens=chunk, checkpoint_layers=tokens > 8192)
    cuda = DEV.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    first = _train_once(policy, t)
    seconds = _train_once(policy, t)
    if tokens > 8192:
        disable_layer_checkpointing(model)
    return {"section": "train", "kind": kind, "tokens": t.num_tokens, "attention": attention, "first_s": first,
            "seconds": seconds, "tok_s": t.num_tokens / seconds,
            "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan")}


class _Done:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.first: float | None = None
        self.flag = threading.Event()

    def __call__(self, ev: Any) -> None:
        if self.first is None and len(ev.token_ids):
            self.first = time.perf_counter()
        self.tokens += [int(x) for x in ev.token_ids]
        if ev.finished:
            self.flag.set()


def _call(engine: Any, rid: str, prompt: np.ndarray, n: int) -> tuple[float, float, list[int]]:
    """(seconds to the first token, seconds in all, tokens) of one greedy call."""
    from services.rollout.engine import GenRequest, SamplingParams

    done = _Done()
    t0 = time.perf_counter()
    engine.submit(GenRequest(rid, prompt, SamplingParams(temperature=0.0, max_new_tokens=n)), done)
    assert done.flag.wait(600), f"{rid} did not finish"
    return (done.first or time.perf_counter()) - t0, time.perf_counter() - t0, done.tokens


def _calls(engine: Any, rid: str, prompts: list[np.ndarray], n: int) -> tuple[float, list[list[int]]]:
    """(seconds until all finished, tokens of each) of greedy calls submitted together."""
    from services.rollout.engine import GenRequest, SamplingParams

    dones = [_Done() for _ in prompts]
    t0 = time.perf_counter()
    for i, (prompt, done) in enumerate(zip(prompts, dones)):
        engine.submit(GenRequest(f"{rid}-{i}", prompt, SamplingParams(temperature=0.0, max_new_tokens=n)), done)
    for i, done in enumerate(dones):
        assert done.flag.wait(600), f"{rid}-{i} did not finish"
    return time.perf_counter() - t0, [d.tokens for d in dones]


# 64 + 160 tokens stay inside the slot buffers' first 256-token capacity: no reallocation (and no
# graph recapture) during the timed call, so it measures the steady decode step
DECODE_PROMPT, DECODE_NEW = 64, 160


def decode_rows(spec: str, batches: tuple[int, ...] = (1, 8)) -> list[dict]:
    """Decode tokens/s with and without CUDA graphs (CPU: default vs static eager forward)."""
    from services.rollout.torch_engine import TorchEngine
    from services.trainer.model import build_model

    model = build_model(spec, dtype=torch.bfloat16, device=DEV, seed=0)
    model.eval()
    cuda = DEV.startswith("cuda")
    modes: list[tuple[str, dict]] = ([("eager", {"cuda_graphs": False}), ("graphs", {"cuda_graphs": True})] if cuda
                                     else [("eager", {}), ("graphs", {"static_decode": True})])
    rng = np.random.default_rng(1)
    rows = []
    for batch in batches:
        prompts = [rng.integers(3, model.config.vocab_size, DECODE_PROMPT).astype(np.int32) for _ in range(batch)]
        row: dict[str, Any] = {"section": "decode", "model": spec, "batch": batch, "new_tokens": DECODE_NEW}
        outs = []
        for mode, kw in modes:
            engine = TorchEngine(model, device=DEV, prefix_cache_bytes=0, max_batch_size=max(batches), **kw)
            engine.start()
            try:
                first_s, _ = _calls(engine, "warm", prompts, DECODE_NEW)  # graphs of these shapes captured here
                seconds, toks = _calls(engine, "timed", prompts, DECODE_NEW)
            finally:
                engine.stop()
            row.update({f"{mode}_tok_s": batch * DECODE_NEW / seconds, f"{mode}_first_s": first_s,
                        f"{mode}_captures": engine.decode_graph_captures})
            outs.append(toks)
        row["ratio"] = row["graphs_tok_s"] / row["eager_tok_s"]
        # bf16: the graph's masked attention kernel rounds differently, so long greedy runs of random
        # weights (flat logits, near ties) may part; the count says how many calls agree throughout
        row["same_calls"] = sum(a == b for a, b in zip(*outs))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def engine_rows(spec: str, context: int = 32768, append: int = 1024) -> list[dict]:
    from services.rollout.torch_engine import TorchEngine
    from services.trainer.model import build_model

    model = build_model(spec, dtype=torch.bfloat16, device=DEV, seed=0)
    model.eval()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    ctx = rng.integers(3, vocab, context).astype(np.int32)
    cached = TorchEngine(model, device=DEV, prefill_chunk_tokens=8192, max_context=context + 4 * append)
    plain = TorchEngine(model, device=DEV, prefill_chunk_tokens=8192, max_context=context + 4 * append,
                        prefix_cache_bytes=0)
    rows = []
    cached.start()
    try:
        warm = rng.integers(3, vocab, min(2048, context // 2)).astype(np.int32)
        _call(cached, "warm", warm, 4)  # kernels and allocator warmed, not the cache of ctx
        ttft_full, _, first = _call(cached, "turn0", ctx, 16)
        grown = np.concatenate([ctx, np.asarray(first, np.int32), rng.integers(3, vocab, append).astype(np.int32)])
        ttft_reuse, _, out_reuse = _call(cached, "turn1", grown, 16)
        stats = cached.prefix_stats()
    finally:
        cached.stop()
    plain.start()
    try:
        _call(plain, "warm", warm, 4)
        ttft_plain, _, out_plain = _call(plain, "turn1", grown, 16)
        _, total, toks = _call(plain, "decode", ctx[:1024], 256)
        decode_tok_s = len(toks) / total
    finally:
        plain.stop()
    rows.append({"section": "engine", "model": spec, "context": context, "append": append,
                 "first_prefill_s": ttft_full, "reuse_s": ttft_reuse, "full_prefill_s": ttft_plain,
                 "speedup": ttft_plain / ttft_reuse, "same_tokens": out_reuse == out_plain,
                 "reused_tokens": stats["reused_tokens"], "decode_tok_s_batch1": decode_tok_s})
    return rows


def write(out: Path, rows: list[dict], skipped: list[str], spec: str, started: float) -> None:
    name = torch.cuda.get_device_properties(0).name if DEV.startswith("cuda") else DEV
    lines = [f"# CUDA paths ({name}, torch {torch.__version__})", "",
             f"`python -m bench.bench_cuda`: {spec}'s shapes, random weights; {time.time() - started:.0f} s in all."]
    if any(r["section"] in ("train", "train-error") for r in rows):
        lines += ["", "## Trainer: one micro-batch, forward + backward (bf16 autocast)", "",
                  "| batch | tokens | attention | tokens/s | peak GPU GiB | first call s |",
                  "| --- | ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        if r["section"] == "train":
            lines.append(f"| {r['kind']} | {r['tokens']:,} | {r['attention']} | {r['tok_s']:,.0f} | {r['peak_gib']:.2f} "
                         f"| {r['first_s']:.1f} |")
        elif r["section"] == "train-error":
            lines.append(f"| {r['kind']} | {r['tokens']:,} | {r['attention']} | failed: {r['error'][:80]} | | |")
    decode = [r for r in rows if r["section"] == "decode"]
    if decode:
        other = "graphs" if DEV.startswith("cuda") else "static (eager)"
        lines += ["", "## Engine decode: CUDA graphs vs eager (bf16)", "",
                  f"Greedy, {DECODE_PROMPT}-token prompts, {DECODE_NEW} new tokens per call, timed after a warm-up "
                  "call of the same shapes (which captures the graphs).", "",
                  f"| batch | eager tokens/s | {other} tokens/s | ratio | first call s (eager / {other}) "
                  "| graphs captured | calls with equal tokens |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in decode:
            lines.append(f"| {r['batch']} | {r['eager_tok_s']:,.1f} | {r['graphs_tok_s']:,.1f} | **{r['ratio']:.2f}x** "
                         f"| {r['eager_first_s']:.2f} / {r['graphs_first_s']:.2f} | {r['graphs_captures']} "
                         f"| {r['same_calls']} of {r['batch']} |")
    for r in rows:
        if r["section"] == "decode-error":
            lines += ["", f"Decode section failed: {r['error'][:200]}"]
    for r in rows:
        if r["section"] == "engine":
            lines += ["", "## Engine: a growing agent context (bf16)", "",
                      f"- {r['append']:,} tokens appended to a {r['context']:,}-token context: {r['reuse_s']:.3f} s to the "
                      f"first token with the prefix cache, {r['full_prefill_s']:.3f} s with a full prefill: "
                      f"**{r['speedup']:.1f}x**; same greedy tokens: {r['same_tokens']}; "
                      f"{r['reused_tokens']:,} tokens reused.",
                      f"- the first {r['context']:,}-token prefill: {r['first_prefill_s']:.3f} s; "
                      f"decode at batch 1: {r['decode_tok_s_batch1']:.0f} tokens/s."]
        elif r["section"] == "engine-error":
            lines += ["", f"Engine section failed: {r['error'][:200]}"]
    if skipped:
        lines += ["", "Left out (budget spent): " + ", ".join(skipped) + "."]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cuda.md"))
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--max-tokens", type=int, default=131072)
    ap.add_argument("--context", type=int, default=32768, help="the engine section's context, tokens")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sections", default="decode,engine,train", help="comma-separated: decode, engine, train")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    global DEV
    DEV = args.device
    if DEV.startswith("cuda") and not torch.cuda.is_available():  # `make bench` on a CPU host goes on
        print("bench_cuda: no CUDA device here, skipped (--device cpu runs a smoke test of the script); "
              "the last GPU host's figures are in bench/results/cuda.md")
        return
    from services.trainer.model import build_model

    started = time.time()
    rows: list[dict] = []
    skipped: list[str] = []
    out = Path(args.out)
    if "decode" in sections:
        try:
            rows += decode_rows(args.model)
        except Exception as exc:  # noqa: BLE001 - a bench reports what failed and goes on
            rows.append({"section": "decode-error", "error": f"{type(exc).__name__}: {exc}"})
            print(json.dumps(rows[-1]), flush=True)
        write(out, rows, skipped, args.model, started)
    if "engine" in sections:
        try:
            rows += engine_rows(args.model, context=args.context, append=min(1024, args.context // 8))
        except Exception as exc:  # noqa: BLE001 - a bench reports what failed and goes on
            rows.append({"section": "engine-error", "error": f"{type(exc).__name__}: {exc}"})
        print(json.dumps(rows[-1]), flush=True)
        write(out, rows, skipped, args.model, started)
    if "train" not in sections:
        return
    if DEV.startswith("cuda"):
        torch.cuda.empty_cache()
    model = build_model(args.model, dtype=torch.float32, device=DEV, seed=0)
    model.train()
    for kind, tokens, attention in TRAIN_ROWS:
        if tokens > args.max_tokens or time.time() - started > args.budget_s:
            skipped.append(f"{kind} {tokens:,} {attention}")
            continue
        try:
            row = train_row(model, kind, tokens, attention)
        except Exception as exc:  # noqa: BLE001 - an OOM or a compile error is a result too
            row = {"section": "train-error", "kind": kind, "tokens": tokens, "attention": attention,
                   "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            model.zero_grad(set_to_none=True)
            if DEV.startswith("cuda"):
                torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
        write(out, rows, skipped, args.model, started)
    write(out, rows, skipped, args.model, started)


if __name__ == "__main__":
    main()

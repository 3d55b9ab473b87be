"""Long-path training benchmark: block-sparse tree attention vs the dense mask, and deep paths.

Run: ``.venv/bin/python -m bench.bench_long_train [--deep]`` (about 6-10 minutes on 2 CPU cores;
``--deep`` adds a 128K-token path in chunks, about 25 minutes more); writes
``bench/results/long_train.md``. The built-in model (builtin-tiny), one torch thread, fp32, one
forward + backward of the tree policy's target log-probs per measurement (what a trainer does per
micro-batch). Each measurement runs in a fresh process so its peak RSS is its own.

1. Packed small trees (many executions, each a trunk with branches, as `make run` packs them):
   dense SDPA tree mask vs block-sparse, at 2K / 4K / 8K tokens (the baseline in the same run).
2. One path (a single agent context, every token trainable) at 8K / 16K / 32K / 64K tokens with
   the block-sparse backend: tokens/s and peak RSS; the dense mask where it fits (8K); and trained
   in chunks of 8K tokens (the trainer's chunk_tokens: exact gradient, activations of one chunk).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

from bench.fresh import in_fresh_process

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "long_train.md"
FOREST = (2048, 4096, 8192)
PATHS = (8192, 16384, 32768, 65536)
CHUNK = 8192  # the trainer's default chunk_tokens
DEEP = 131072  # --deep


def _measure(kind: str, tokens: int, attention: str) -> dict:
    """In this process: build the batch, run forward + backward once to warm up, then time one."""
    import dataclasses

    import numpy as np
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from services.task.model import ensure_builtin_model
    from services.trainer.synthetic import make_step
    from services.trainer.tree_forward import TreePolicy, TreeTensors

    model = AutoModelForCausalLM.from_pretrained(str(ensure_builtin_model(ROOT / ".gyre" / "models")),
                                                 attn_implementation="sdpa")
    vocab = model.config.vocab_size
    if kind == "forest":  # executions of ~120 tokens: a trunk and two levels of two branches
        step = make_step(5, num_executions=max(1, tokens // 120), depth=2, branching=2, micro_batch_tokens=1 << 30)
        t = TreeTensors.from_batch(step.batches[0])
        t = dataclasses.replace(t, input_ids=t.input_ids % vocab, target_ids=t.target_ids % vocab)
    else:  # one path: token i's parent is i - 1, every token after the first is a target
        n = tokens
        ids = torch.from_numpy(np.random.default_rng(0).integers(3, vocab, n)).long()
        idx = torch.arange(1, n)
        t = TreeTensors(input_ids=ids, position_ids=torch.arange(n), subtree_end=torch.full((n,), n),
                        target_index=idx, target_parent=idx - 1, target_ids=ids[1:],
                        old_logprobs=torch.zeros(n - 1), advantages=torch.ones(n - 1),
                        loss_weights=torch.full((n - 1,), 1.0 / (n - 1)), weight_version=torch.zeros(n - 1).long())
    chunk = CHUNK if attention == "chunked" else 0
    policy = TreePolicy(model, attention="blocks" if chunk else attention, max_dense_tokens=1 << 30,
                        sparse_block_tokens=256, chunk_tokens=chunk)
    rounds = []
    for _ in range(2 if tokens <= 8192 else 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if policy.chunked(t):
            policy.train_chunked(t, lambda lp, _ent, sel: (lp * t.loss_weights[sel]).sum())
        else:
            lp, _ = policy.target_logprobs(t)
            (lp * t.loss_weights).sum().backward()
        rounds.append(time.perf_counter() - t0)
    seconds = rounds[-1]
    return {"kind": kind, "tokens": t.num_tokens, "attention": attention, "seconds": seconds,
            "tok_s": t.num_tokens / seconds, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _run(kind: str, tokens: int, attention: str) -> dict:
    return in_fresh_process("bench.bench_long_train", kind, str(tokens), attention)


def main() -> None:
    forest = [(n, _run("forest", n, "sdpa"), _run("forest", n, "blocks")) for n in FOREST]
    deep = "--deep" in sys.argv[1:]
    paths = [(n, _run("path", n, "sdpa") if n <= 8192 else None, _run("path", n, "blocks"),
              _run("path", n, "chunked") if n > CHUNK else None) for n in PATHS]
    if deep:  # 128K: in chunks only (the whole path at once would keep every activation)
        paths.append((DEEP, None, None, _run("path", DEEP, "chunked")))
    lines = [
        "# Long-path training (bench/bench_long_train.py)",
        "",
        "Built-in model (builtin-tiny: 2 layers, hidden 128), CPU, 1 torch thread, fp32; one forward + backward "
        "of the tree policy's target log-probs (a trainer's micro-batch), each in a fresh process (its own peak "
        "RSS, which includes the ~350 MiB of torch + transformers). Baseline in the same run: the dense SDPA "
        "tree mask.",
        "",
        "## Packed small trees (executions of ~120 tokens, trunk + 2 levels x 2 branches)",
        "",
        "| tokens | dense tok/s | block-sparse tok/s | speed-up | dense peak RSS MiB | block-sparse peak RSS MiB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for n, d, b in forest:
        lines.append(f"| {d['tokens']:,} | {d['tok_s']:.0f} | {b['tok_s']:.0f} | **{b['tok_s'] / d['tok_s']:.1f}x** | "
                     f"{d['peak_rss_mib']:.0f} | {b['peak_rss_mib']:.0f} |")
    lines += [
        "",
        "## One path (a single agent context, every token a target)",
        "",
        f"| depth (tokens) | block-sparse tok/s | block-sparse peak RSS MiB | in {CHUNK // 1024}K chunks tok/s | "
        f"in {CHUNK // 1024}K chunks peak RSS MiB | dense tok/s | dense peak RSS MiB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, d, b, c in paths:
        dense = f"{d['tok_s']:.0f} | {d['peak_rss_mib']:.0f}" if d else "- (N x N mask not built) | -"
        chunked = f"{c['tok_s']:.0f} | {c['peak_rss_mib']:.0f}" if c else "- (one chunk) | -"
        block = f"{b['tok_s']:.0f} | {b['peak_rss_mib']:.0f}" if b else "- (not run: see below) | -"
        lines.append(f"| {n:,} | {block} | {chunked} | {dense} |")
    lines += [
        "",
        "A path costs its causal triangle in blocks (half the square), so tokens/s falls with depth as attention "
        "grows; memory grows linearly (activations of each token, no N x N tensor). In chunks, the activations "
        "are one chunk's: what grows with depth is the keys/values kept for the later chunks (and their "
        "gradients), 2 x layers x kv width per token, and the chunks cost one more forward. "
        + ("128K (`--deep`) is run in chunks only: about 25 minutes of one core (attention grows with the square "
           "of depth)." if deep else "128K was not run (`--deep` adds it, in chunks only: about 25 minutes of "
                                      "one core, attention growing with the square of depth)."),
        "",
    ]
    RESULTS.write_text("\n".join(lines))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(_measure(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
    else:
        main()

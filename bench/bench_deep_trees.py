"""Deep branching trees: trained in DFS pieces (every tree token once) against DFS chunks with copies.

Run: ``.venv/bin/python -m bench.bench_deep_trees [--shape deep|bushy] [--depths D,D] [--budget B] [--kv-budget K]``
(both shapes at their own sizes: about 12 minutes on 2 CPU cores); writes ``bench/results/deep_trees.md``
and ``bench/results/deep_trees-bushy.md``.

An agent-shaped execution (``_execution``): a main context that grows turn by turn to ``depth``
tokens, the last two turns retried (branches at the bottom of the context), a sub-agent forked from
the main context at three quarters of its depth (its own turns on top of that prefix), and a
compaction (a summary call, then main restarting short). Two of them (different seeds) make the
step. The trajectory packer packs them under ``budget`` both ways (``split_tree``): ``context``
(today's default before pieces: DFS chunks, each with its root path copied in) and ``pieces`` (the
whole tree one micro-batch, DFS pieces of at most the budget, earlier pieces' keys/values kept);
the trainer's tree policy (built-in model, block-sparse attention, ``chunk_tokens`` = the budget)
runs forward + backward over every micro-batch. ``--kv-budget``: also ``pieces`` with that kv budget
(trees larger than it cut into chunks of at most that many tokens, their root paths recomputed as
context instead of kept). Each (depth, split) runs in a fresh process (its own peak RSS); all in the
same run, the gradients compared.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

from bench.fresh import in_fresh_process

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "deep_trees.md"


def _execution(execution_id: str, depth: int, vocab: int, seed: int) -> list:
    """The TITO calls of one deep, branching execution (see module docstring)."""
    import numpy as np

    from services.common.roles import AgentRole
    from services.trajectory.records import TitoCall

    rng = np.random.default_rng(seed)
    tool, out = max(16, depth // 40), 32
    calls: list[TitoCall] = []

    def call(cid: str, agent: str, role: AgentRole, prompt: np.ndarray) -> TitoCall:
        ids = rng.integers(3, vocab, out)
        c = TitoCall(execution_id, cid, agent, role, ids, -rng.uniform(0.05, 3.0, out).astype(np.float32), 0,
                     prompt_ids=prompt)
        calls.append(c)
        return c

    context = rng.integers(3, vocab, tool)
    turn = 0
    forked = False
    while len(context) + out < depth:
        c = call(f"main-{turn}", "main", AgentRole.MAIN, context)
        if len(context) + 2 * (tool + out) >= depth:  # the last two turns: the harness retried them
            call(f"main-{turn}-retry", "main", AgentRole.MAIN, context)
        if not forked and len(context) >= 3 * depth // 4:  # a sub-agent forked from the main context
            forked = True
            sub = context.copy()
            for k in range(3):
                s = call(f"sub-{k}", "sub", AgentRole.SUBAGENT, sub)
                sub = np.concatenate([sub, s.output_ids, rng.integers(3, vocab, tool)])
        context = np.concatenate([context, c.output_ids, rng.integers(3, vocab, tool)])
        turn += 1
    summary = call("summary", "main", AgentRole.SUMMARY, context)
    call("main-after-compaction", "main", AgentRole.MAIN,
         np.concatenate([summary.output_ids, rng.integers(3, vocab, tool)]))
    return calls


def _bushy(execution_id: str, depth: int, vocab: int, seed: int) -> list:
    """A bushy execution: a shared prefix of ``depth // 4`` tokens and eight sub-agents forked from it,
    each growing its own context by turns to ``depth`` tokens (the tree is ~6x its depth)."""
    import numpy as np

    from services.common.roles import AgentRole
    from services.trajectory.records import TitoCall

    rng = np.random.default_rng(seed)
    tool, out = max(16, depth // 40), 32
    prefix = rng.integers(3, vocab, depth // 4)
    calls = []
    for k in range(8):
        context, turn = prefix, 0
        while len(context) + out < depth:
            ids = rng.integers(3, vocab, out)
            calls.append(TitoCall(execution_id, f"sub-{k}-{turn}", f"sub-{k}", AgentRole.SUBAGENT, ids,
                                  -rng.uniform(0.05, 3.0, out).astype(np.float32), 0, prompt_ids=context))
            context = np.concatenate([context, ids, rng.integers(3, vocab, tool)])
            turn += 1
    return calls


SHAPES = {"deep": _execution, "bushy": _bushy}
SHAPE_TEXT = {"deep": "each a main context grown to the depth below, its last two turns retried, a sub-agent forked "
                      "at three quarters of the depth and a compaction",
              "bushy": "each eight sub-agents forked from a shared prefix of a quarter of the depth below, each "
                       "grown to that depth"}


def _measure(depth: int, split: str, budget: int, kv_budget: int = 0, shape: str = "deep") -> dict:
    """In this process: pack the step ``split``-wise and train every micro-batch once (timed)."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.task.model import ensure_builtin_model
    from services.trainer.tree_forward import TreePolicy, TreeTensors
    from services.trajectory.packing import assemble, pack_chunks, split_tree
    from services.trajectory.tree import ExecutionTree

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(ensure_builtin_model(ROOT / ".gyre" / "models")),
                                                 attn_implementation="sdpa")
    vocab = model.config.vocab_size
    trees, stats = {}, []
    for e in range(2):
        tree = ExecutionTree(f"e{e}")
        for c in SHAPES[shape](f"e{e}", depth, vocab, seed=e):
            tree.add(c)
        trees[f"e{e}"] = tree.arrays()
        stats.append(tree.stats())
    chunks = [c for eid, a in trees.items() for c in split_tree(eid, a, budget, split=split, kv_budget=kv_budget)]
    weights = {eid: 1.0 / (a.num_trainable * len(trees)) for eid, a in trees.items()}
    batches = [assemble(b, step=0, advantages={eid: 1.0 for eid in trees}, token_weights=weights,
                        token_budget=budget) for b in pack_chunks(chunks, budget)]
    policy = TreePolicy(model, attention="blocks", sparse_block_tokens=256, chunk_tokens=budget)
    model.train()
    t0 = time.perf_counter()
    for batch in batches:
        t = TreeTensors.from_batch(batch)
        if policy.chunked(t):
            policy.train_chunked(t, lambda lp, _ent, sel: (lp * t.loss_weights[sel] * t.advantages[sel]).sum())
        else:
            lp, _ = policy.target_logprobs(t)
            (lp * t.loss_weights * t.advantages).sum().backward()
    seconds = time.perf_counter() - t0
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    name = f"{split}-kv{kv_budget}" if kv_budget else split
    torch.save(grads, f"/tmp/gyre-bench-deep-trees-{depth}-{name}.pt")
    return {"depth": depth, "split": name, "budget": budget, "micro_batches": len(batches),
            "tree_tokens": sum(s.tree_tokens for s in stats), "naive_tokens": sum(s.naive_tokens for s in stats),
            "paths": sum(s.paths for s in stats), "processed_tokens": sum(len(b) for b in batches),
            "seconds": seconds, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _run(depth: int, split: str, budget: int, kv_budget: int = 0, shape: str = "deep") -> dict:
    return in_fresh_process("bench.bench_deep_trees", str(depth), split, str(budget), str(kv_budget), "--shape", shape,
                            timeout_s=7200)


def _grad_diff(depth: int, name: str = "pieces") -> float:
    import torch

    a = torch.load(f"/tmp/gyre-bench-deep-trees-{depth}-context.pt")
    b = torch.load(f"/tmp/gyre-bench-deep-trees-{depth}-{name}.pt")
    return float((a - b).norm() / a.norm())


# what `make bench` runs (no arguments): both shapes, each at its own sizes
DEFAULTS = {"deep": {"depths": "16384,32768", "budget": 4096, "kv_budget": 0},
            "bushy": {"depths": "4096", "budget": 1024, "kv_budget": 8192}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", help="depths, tokens, comma-separated (default: the shape's)")
    p.add_argument("--budget", type=int, help="micro-batch token budget (and chunk_tokens; default: the shape's)")
    p.add_argument("--kv-budget", type=int, help="also pieces with this kv budget (0: not run; default: the "
                                                 "shape's); it bounds the kept keys/values only above the trees' "
                                                 "depth (a token needs all its ancestors')")
    p.add_argument("--shape", choices=sorted(SHAPES), default="",
                   help="deep: one main context with branches at depth (deep_trees.md); bushy: eight sub-agents "
                        "forked from a shared prefix (deep_trees-bushy.md); default: both")
    p.add_argument("--one", nargs=4, help=argparse.SUPPRESS)  # depth split budget kv: one measurement here
    args = p.parse_args()
    if args.one:
        print(json.dumps(_measure(int(args.one[0]), args.one[1], int(args.one[2]), int(args.one[3]),
                                  args.shape or "deep")), flush=True)
        return
    for shape in [args.shape] if args.shape else list(DEFAULTS):
        given = {k: v for k, v in (("depths", args.depths), ("budget", args.budget), ("kv_budget", args.kv_budget))
                 if v is not None}
        _table(argparse.Namespace(shape=shape, **{**DEFAULTS[shape], **given}))


def _table(args: argparse.Namespace) -> None:
    """Measure one shape at its sizes and write its table."""
    rows = []
    for depth in (int(x) for x in args.depths.split(",")):
        ctx, pcs = _run(depth, "context", args.budget, 0, args.shape), _run(depth, "pieces", args.budget, 0, args.shape)
        kv = _run(depth, "pieces", args.budget, args.kv_budget, args.shape) if args.kv_budget else None
        rows.append((ctx, pcs, kv, _grad_diff(depth), _grad_diff(depth, kv["split"]) if kv else 0.0))
    lines = [
        "# Deep branching trees: DFS pieces against DFS chunks with context copies",
        "",
        f"`bench/bench_deep_trees.py --shape {args.shape}`: two executions per step, " + SHAPE_TEXT[args.shape] +
        f"; packed under a {args.budget:,}-token budget and trained once (forward + backward of every "
        f"micro-batch) by the built-in model's tree policy (block-sparse attention, chunk_tokens = the budget, "
        f"1 torch thread, fp32). `context`: DFS chunks, each carrying its root path again; `pieces`: each tree one "
        f"micro-batch in DFS pieces of at most the budget, earlier pieces' keys/values kept"
        + (f"; `pieces-kv{args.kv_budget}`: pieces, trees larger than {args.kv_budget:,} tokens cut into chunks of at "
           f"most that many with their root paths recomputed" if args.kv_budget else "")
        + ". All in the same run, each in a fresh process.",
        "",
        "| depth | paths | naive tokens | tree tokens | split | micro-batches | processed tokens | processed / tree | "
        "seconds | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ctx, pcs, kv, _, _ in rows:
        for r in (ctx, pcs, *([kv] if kv else [])):
            lines.append(f"| {r['depth']:,} | {r['paths']} | {r['naive_tokens']:,} | {r['tree_tokens']:,} | "
                         f"{r['split']} | {r['micro_batches']} | {r['processed_tokens']:,} | "
                         f"{r['processed_tokens'] / r['tree_tokens']:.2f} | {r['seconds']:.1f} | "
                         f"{r['peak_rss_mib']:.0f} |")
    lines += ["", "| depth | split | tokens saved | time saved | time saved / tokens saved | "
                  "gradient difference (relative) |", "|---|---|---|---|---|---|"]
    for ctx, pcs, kv, diff, kv_diff in rows:
        for r, d in ((pcs, diff), *([(kv, kv_diff)] if kv else [])):
            tok = 1 - r["processed_tokens"] / ctx["processed_tokens"]
            sec = 1 - r["seconds"] / ctx["seconds"]
            lines.append(f"| {ctx['depth']:,} | {r['split']} | {tok:.0%} | {sec:.0%} | {sec / tok if tok else 0:.2f} | "
                         f"{d:.1e} |")
    lines += [
        "",
        "In pieces every tree token is computed once in the forward and once in the backward, plus the second "
        "forward of the chunked training (the first pass makes the keys/values the later pieces attend to); "
        "what grows with the tree is those kept keys/values and their gradients (2 x layers x kv width per "
        "token), not the activations. Context chunks recompute every chunk's root path: at depth D and budget B "
        "about D / B copies of a path up to D deep. With a kv budget K (`pieces-kvK`) a tree larger than K is cut "
        "into chunks of at most K tokens, each trained in pieces: the kept keys/values are bounded by K, and "
        "about D / K root paths are recomputed. The gradients agree (the last column).",
        "",
    ]
    out = RESULTS if args.shape == "deep" else RESULTS.with_name(f"deep_trees-{args.shape}.md")
    out.write_text("\n".join(lines))
    print(out.read_text())


if __name__ == "__main__":
    main()

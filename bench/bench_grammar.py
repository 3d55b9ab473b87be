"""Grammar-constrained decoding: what the mask costs per token.

Run: ``.venv/bin/python -m bench.bench_grammar`` (about 1-2 minutes on 2 CPU cores); writes
``bench/results/grammar.md``.

1. The mask alone, on SmolLM2's 49,152-token vocabulary: per decode step, ``constrain_rows``
   (bitmask fill per constrained row, masking, the two log-sum-exps) against the sampler's own
   work on the same logits (``sample_tokens``), at 1 and 8 constrained rows. The matchers walk
   the grammar with the tokens actually sampled (JSON schema of a tool's arguments).
2. End to end in the engine: SmolLM2-135M-Instruct on CPU, the same 4 chat prompts, greedy, at
   most 48 new tokens, decoded free and under a json_schema grammar in the same run (after a
   warm-up of each): tokens/s (prefill included) and the tokens the grammar forced.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from services.models.source import SMOLLM2, resolve_model
from services.rollout.grammar import GrammarBook, GrammarSpec, constrain_rows
from services.rollout.sampling import sample_tokens

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "grammar.md"
VOCAB = 49152
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 30},
                                           "by": {"enum": ["train", "plane", "car"]},
                                           "notes": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["city", "days", "by"], "additionalProperties": False}
SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))


def mask_cost(book: GrammarBook, rows: int, steps: int = 200) -> dict[str, float]:
    g = torch.Generator().manual_seed(rows)
    cons = [book.constraint(SPEC, [2]) for _ in range(rows)]
    temp, ones, zeros = torch.ones(rows), torch.ones(rows), torch.zeros(rows, dtype=torch.long)
    mask_s = sample_s = 0.0
    done = 0
    for _step in range(steps):
        logits = torch.randn(rows, VOCAB, generator=g) * 3
        u = torch.rand(rows, generator=g, dtype=torch.float64)
        t0 = time.perf_counter()
        sample_tokens(logits.clone(), temp, ones, zeros, u)
        t1 = time.perf_counter()
        constrain_rows(logits, cons, temp)
        t2 = time.perf_counter()
        tok, _ = sample_tokens(logits, temp, ones, zeros, u)
        sample_s, mask_s = sample_s + (t1 - t0), mask_s + (t2 - t1)
        for i, c in enumerate(cons):
            c.accept(int(tok[i]))
            if c.terminated:  # start the next object: the matcher keeps walking the grammar
                cons[i] = book.constraint(SPEC, [2])
                done += 1
    return {"rows": rows, "mask_ms": 1e3 * mask_s / steps, "sample_ms": 1e3 * sample_s / steps, "objects": done}


def engine_run(path: Path) -> list[dict[str, float]]:
    from transformers import AutoTokenizer

    from services.rollout.engine import GenRequest, SamplingParams
    from services.rollout.torch_engine import TorchEngine
    from tests.unit.test_rollout_engine import Collector

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    asks = ["Plan a trip to Rome.", "Plan a trip to Oslo by train.", "Where should I go for a week?",
            "Book me three days in Lisbon."]
    prompts = [np.asarray(tok.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False), np.int32) for a in asks]
    engine = TorchEngine.from_pretrained(str(path), device="cpu", max_batch_size=8, prefix_cache_bytes=0)
    engine.start()
    rows = []
    try:
        # warm-ups: the first call of each kind pays one-time costs (the engine's tokenizer and grammar
        # compile on its first constrained request)
        for label, grammar in (("warm-up", None), ("warm-up-g", SPEC), ("free", None), ("json_schema", SPEC)):
            col = Collector()
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                engine.submit(GenRequest(f"{label}-{i}", p, SamplingParams(
                    temperature=0.0, max_new_tokens=48, stop_token_ids=(2,), grammar=grammar)), col)
            evs = [col.wait(f"{label}-{i}", timeout=600) for i in range(len(prompts))]
            wall = time.perf_counter() - t0
            n = sum(len(col.tokens(f"{label}-{i}")) for i in range(len(prompts)))
            forced = sum(int(e.forced.sum()) for es in evs for e in es if e.forced is not None)
            if not label.startswith("warm-up"):
                rows.append({"label": label, "tokens": n, "wall_s": wall, "tok_s": n / wall, "forced": forced})
    finally:
        engine.stop()
    return rows


def main() -> None:
    torch.set_num_threads(1)
    path = resolve_model(SMOLLM2)
    book = GrammarBook.from_dir(path, VOCAB)
    assert book is not None
    costs = [mask_cost(book, r) for r in (1, 8)]
    runs = engine_run(path)
    free = next(r for r in runs if r["label"] == "free")
    lines = ["# Grammar-constrained decoding: the mask's cost", "",
             "`python -m bench.bench_grammar` (`bench/bench_grammar.py`), CPU, one torch thread.", "",
             "## The mask alone, per decode step (SmolLM2's 49,152-token vocabulary)", "",
             "A JSON schema of a tool's arguments (string, bounded integer, enum, array); the matchers walk it",
             "with the tokens actually sampled from random logits. Baseline: the sampler on the same logits.", "",
             "| constrained rows | mask ms/step | sampler ms/step | mask / sampler | objects completed |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for c in costs:
        lines.append(f"| {c['rows']} | {c['mask_ms']:.3f} | {c['sample_ms']:.3f} | "
                     f"{c['mask_ms'] / c['sample_ms']:.2f}x | {c['objects']} |")
    lines += ["", "## In the engine: SmolLM2-135M-Instruct, 4 requests batched, greedy, 48 new tokens", "",
              "| decoding | tokens | wall s | tokens/s | vs free | forced tokens |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in runs:
        lines.append(f"| {r['label']} | {r['tokens']} | {r['wall_s']:.2f} | {r['tok_s']:.1f} | "
                     f"{r['tok_s'] / free['tok_s']:.2f}x | {r['forced']} |")
    lines += ["", "Forced tokens (the grammar allowed exactly one) are recorded as such and trained as context;",
              "see `docs/rollout-engine.md`, \"Structured outputs\".", ""]
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

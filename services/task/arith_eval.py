"""Held-out evaluation of a model on arith-v1 (greedy), with an in-process rollout engine.

    python -m services.task.arith_eval --model smollm2-135m-instruct --n 64
    python -m services.task.arith_eval --model /path/to/trained/checkpoint --n 64 --json eval.json

``--model`` is anything services.models.source resolves (a name or a local checkpoint directory
with its tokenizer), so the same command measures a policy before and after RL. Executions run
``--concurrency`` at a time so the engine batches them. Prints one summary line (and writes the
per-task replies to ``--json``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name or checkpoint directory")
    parser.add_argument("--n", type=int, default=64, help="held-out tasks to evaluate")
    parser.add_argument("--turns", type=int, default=3, help="ArithParams.turns")
    parser.add_argument("--max-operand", type=int, default=10, help="ArithParams.max_operand")
    parser.add_argument("--split", default="heldout", choices=("train", "heldout"))
    parser.add_argument("--concurrency", type=int, default=24, help="executions in flight (engine batch)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="generation cap of one turn")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", default="", help="write per-task results here")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from services.models.source import resolve_model
    from services.rollout.torch_engine import TorchEngine
    from services.task.arith import ArithConfig, ArithParams, evaluate
    from services.task.engine_client import EngineModelClient

    params = ArithParams(turns=args.turns, max_operand=args.max_operand)  # validates before the model loads
    torch.set_num_threads(args.torch_threads)
    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    engine = TorchEngine.from_pretrained(str(path), device="cpu", max_context=4096,
                                         max_batch_size=args.concurrency, torch_threads=args.torch_threads)
    engine.start()
    t = time.perf_counter()
    try:
        ev = evaluate(EngineModelClient(engine), tokenizer, n=args.n, params=params, split=args.split,
                      concurrency=args.concurrency,
                      config=ArithConfig(temperature=0.0, max_new_tokens=args.max_new_tokens, timeout_s=3600.0))
    finally:
        engine.stop()
    seconds = time.perf_counter() - t
    summary = {"model": args.model, "split": args.split, "tasks": args.n, "params": params.code,
               "accuracy": ev.accuracy, "mean_reward": ev.mean_reward, "turn_accuracy": ev.turn_accuracy,
               "seconds": round(seconds, 1)}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**summary, "results": [{"task_id": r.task_id, "status": r.status, "replies": r.replies,
                                               "reward": r.reward} for r in ev.results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

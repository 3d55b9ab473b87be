"""``gyre trajectory stats --records FILE.jsonl [--max-paths K]``: tree statistics of recorded executions.

Prints one JSON object mapping each execution id (in order of first appearance) to
``{"paths", "naive_tokens", "tree_tokens", "trainable_tokens"}`` (semantics in ``tree.py``).
Input is the TITO JSONL of DESIGN.md; prompts may be full or delta-encoded. Bad input prints one
sentence naming the line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from services.trajectory.records import read_jsonl_file
from services.trajectory.tree import ExecutionTree, TreeStats


def stats_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gyre trajectory stats",
                                     description="Tree statistics of TITO records (JSONL).")
    parser.add_argument("--records", required=True, help="TITO records, JSONL (DESIGN.md format).")
    parser.add_argument("--max-paths", type=int, default=None,
                        help="Keep at most K paths per execution (role priority, then record order).")
    args = parser.parse_args(argv)
    if args.max_paths is not None and args.max_paths < 1:
        print("gyre trajectory stats: --max-paths must be at least 1", file=sys.stderr)
        return 2
    try:
        calls, executions = read_jsonl_file(args.records)
        trees: dict[str, ExecutionTree] = {}
        for call in calls:
            tree = trees.get(call.execution_id)
            if tree is None:
                tree = trees[call.execution_id] = ExecutionTree(call.execution_id)
            tree.add(call)
    except ValueError as exc:
        print(f"gyre trajectory stats: {exc}", file=sys.stderr)
        return 2
    out = {}
    for eid in executions:
        stats = trees[eid].stats(args.max_paths) if eid in trees else TreeStats(0, 0, 0, 0)
        out[eid] = stats.as_dict()
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0

"""TITO record files for replay tests: agent-shaped executions (a growing main context, a retry
branch, a sub-agent, a compaction) over the built-in model's vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def agent_execution(rng: np.random.Generator, execution_id: str, *, turns: int, tool_tokens: int,
                    output_tokens: int, vocab: tuple[int, int] = (3, 120), deep: bool = False) -> list[dict]:
    """Calls of one execution: main turns that grow one context, a retry of turn 1 (a new branch),
    one sub-agent call with its own context, and a compaction after which main restarts short.
    ``deep``: the branches sit deep instead: the retry is of the last turn, and the sub-agent is
    forked from the whole main context (its prompt = that context + its task)."""
    def toks(n: int) -> list[int]:
        return rng.integers(*vocab, n).tolist()

    def call(call_id: str, agent: str, role: str, prompt: list[int]) -> dict:
        out = toks(output_tokens)
        return {"execution_id": execution_id, "call_id": call_id, "agent_id": agent, "role": role,
                "prompt_ids": prompt, "output_ids": out,
                "output_logprobs": np.round(-rng.uniform(0.05, 3.0, len(out)), 4).tolist(), "weight_version": 0}

    calls, context = [], toks(tool_tokens)
    for turn in range(turns):
        c = call(f"main-{turn}", "main", "main", context)
        calls.append(c)
        if turn == (turns - 1 if deep else 1):  # the harness retried this turn: same context, another output
            calls.append(call("main-1-retry", "main", "main", context))
        context = context + c["output_ids"] + toks(tool_tokens)
    calls.append(call("sub-0", "sub", "subagent", (context if deep else []) + toks(tool_tokens)))
    summary = call("summary-0", "main", "summary", context)
    calls.append(summary)
    calls.append(call("main-after-compaction", "main", "main", summary["output_ids"] + toks(tool_tokens)))
    return calls


def write_records(path: Path, *, executions: int = 4, turns: int = 4, tool_tokens: int = 40,
                  output_tokens: int = 8, seed: int = 0, deep: bool = False) -> Path:
    rng = np.random.default_rng(seed)
    lines: list[dict] = []
    for e in range(executions):
        eid = f"exec-{e}"
        lines += agent_execution(rng, eid, turns=turns, tool_tokens=tool_tokens, output_tokens=output_tokens,
                                 deep=deep)
        lines.append({"execution_id": eid, "group_id": f"task-{e // 2}", "status": "finished",
                      "reward": float(e % 2)})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path

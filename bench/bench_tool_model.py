"""The tool-calling built-in model (``builtin-tools``): its build and its warm start's held-out pass rate.

    .venv/bin/python -m bench.bench_tool_model [--tasks 16] [--sampled 8] [--set FIELD=VALUE ...]

Builds the default ``ToolModelSpec`` into a fresh temporary cache (so the build time is measured,
not a cache hit), then runs the built-in tool agent in process on held-out ``xlong-tools-v1`` tasks:
greedy (what the scheduler's evaluations use) and sampled at temperature 1 (what RL sees).
Writes ``bench/results/tool_model.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=16, help="held-out tasks, greedy")
    ap.add_argument("--sampled", type=int, default=8, help="held-out tasks, temperature 1")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "tool_model.md"))
    ap.add_argument("--keep-in", default="", help="a model cache directory to copy the built model into "
                    "(e.g. .gyre/models, so gyre run and bench_harness_loops do not build it again)")
    ap.add_argument("--model", default="", help="measure this built tool model directory instead of building "
                    "one (its build time is the one its stamp recorded)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a ToolModelSpec field of a variant to measure instead of the default "
                         "(e.g. --set smolagents_demo_tasks=100 --set sft_steps=600); repeatable")
    args = ap.parse_args()
    try:
        spec = spec_with(args.set)
    except ValueError as exc:
        ap.error(str(exc))

    import torch
    from transformers import AutoModelForCausalLM

    from services.task.evaluate import evaluate
    from services.task.local_client import LocalModelClient
    from services.task.spec import task_ids
    from services.task.tool_env import INSTRUCTIONS, TOOLS
    from services.task.tool_model import ensure_tool_model
    from services.task.tool_tokenizer import ToolCodec, render_system

    with tempfile.TemporaryDirectory(prefix="gyre-tool-model-") as cache:
        t0 = time.monotonic()
        path = Path(args.model) if args.model else ensure_tool_model(cache, spec=spec)
        wall = time.monotonic() - t0
        stamp = json.loads((path / "gyre_build.json").read_text())
        if args.model:
            wall = float(stamp.get("build_s", 0.0))
        if args.keep_in:
            import shutil

            kept = Path(args.keep_in) / path.name
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(path, kept)
        torch.set_num_threads(2)
        client = LocalModelClient(AutoModelForCausalLM.from_pretrained(str(path)))
        codec = ToolCodec.from_dir(path)
        system = codec.encode(render_system(INSTRUCTIONS, TOOLS))
        ids = task_ids(args.tasks, split="heldout", family="xlong-tools-v1")
        greedy = evaluate(client, ids, codec=codec, concurrency=1)
        sampled = evaluate(client, ids[:args.sampled], codec=codec, concurrency=1, temperature=1.0)
        shell = _shell_pass_rate(client, codec, ids)
        smol = _smolagents_pass_rate(client, codec, ids)
        claude = _claude_code_pass_rate(client, codec, ids)
    lines = [
        "# The built-in tool-calling model (`builtin-tools`)",
        "",
        f"`python -m bench.bench_tool_model{''.join(' --set ' + s for s in args.set)}`: "
        f"{'the default `ToolModelSpec`' if not args.set else 'a variant of the default `ToolModelSpec`'} "
        "built into a fresh cache on one torch thread, then the built-in tool agent in process on held-out "
        "`xlong-tools-v1` tasks. 2-core machine.",
        "",
        "| build wall | vocabulary | system turn (tokens) | warm-start loss first -> last | "
        "held-out greedy pass (reward) | held-out sampled T=1 pass (reward) | shell dialect greedy pass | "
        "smolagents loop greedy pass | Claude Code conversation greedy pass |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {wall:.0f} s | {stamp['vocab']} | {len(system)} | {stamp['sft_loss_first']:.2f} -> "
        f"{stamp['sft_loss_last']:.3f} | {greedy.pass_rate:.3f} ({greedy.mean_reward:.2f}) on {args.tasks} | "
        f"{sampled.pass_rate:.3f} ({sampled.mean_reward:.2f}) on {args.sampled} | {shell:.3f} on {args.tasks} | "
        f"{smol:.3f} on {args.tasks} | {claude:.3f} on {args.tasks} |",
        "",
        "The shell dialect: the same held-out tasks as mini-swe-agent runs them (``gyre-task`` commands "
        "in bash calls, one conversation, no compaction; services.task.tool_demos.run_shell_demo), greedy.",
        "smolagents' loop: its ToolCallingAgent, unmodified, on the same tasks, its requests through the gateway's "
        "endpoint code in process (services.task.local_gateway; a required call's opening forced and its "
        "arguments sampled under the engine's grammar, as on the live stack), greedy.",
        "Claude Code's conversation: the bodies the pinned CLI sends in the claude-code loop (its system, its Bash "
        "tool, ``gyre-task`` commands; services.task.claude_code_dialect), through the gateway's Messages endpoint "
        "code in process, greedy (the live CLI sends no temperature: the engine samples at 1).",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def spec_with(settings: list[str]) -> object:
    """The default ToolModelSpec with ``FIELD=VALUE`` settings (top-level int, float or str fields);
    ValueError (one sentence) for an unknown field or a value of the wrong type."""
    import dataclasses

    from services.task.tool_model import ToolModelSpec

    spec = ToolModelSpec()
    fields = {f.name: type(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
    changes: dict[str, object] = {}
    for item in settings:
        name, sep, value = item.partition("=")
        kind = fields.get(name.strip())
        if not sep or kind not in (int, float, str):
            settable = ", ".join(n for n, k in fields.items() if k in (int, float, str))
            raise ValueError(f"--set takes FIELD=VALUE with FIELD one of {settable}; got {item!r}")
        try:
            changes[name.strip()] = kind(value.strip())
        except ValueError:
            raise ValueError(f"--set {name.strip()} takes a {kind.__name__}; got {value.strip()!r}") from None
    return dataclasses.replace(spec, **changes)  # the spec validates its own ranges


def _shell_pass_rate(client: object, codec: object, ids: list[str]) -> float:
    """Held-out tasks solved whole in the shell dialect, greedy."""
    import random

    from services.task.spec import task_from_id
    from services.task.tool_demos import run_shell_demo

    passed = 0
    for n, tid in enumerate(ids):
        task = task_from_id(tid)
        env = run_shell_demo(task, client, codec=codec, fix_turns=1,  # type: ignore[arg-type]
                             max_turns=6 * sum(len(m.steps) + 2 for m in task.modules), max_new_tokens=48,
                             rng=random.Random(n), temperature=0.0)
        passed += all(env.module_passed.get(m.name) for m in task.modules)
    return passed / len(ids)


def _smolagents_pass_rate(client: object, codec: object, ids: list[str]) -> float:
    """Held-out tasks solved whole through smolagents' loop, greedy."""
    import random

    from services.task.spec import task_from_id
    from services.task.tool_demos import run_smolagents_demo

    passed = 0
    for n, tid in enumerate(ids):
        task = task_from_id(tid)
        env = run_smolagents_demo(task, client, codec=codec, fix_turns=1,  # type: ignore[arg-type]
                                  max_turns=6 * sum(len(m.steps) + 2 for m in task.modules), rng=random.Random(n),
                                  temperature=0.0, execution_id=f"heldout-{n}")
        passed += all(env.module_passed.get(m.name) for m in task.modules)
    return passed / len(ids)


def _claude_code_pass_rate(client: object, codec: object, ids: list[str]) -> float:
    """Held-out tasks solved whole through Claude Code's conversation, greedy."""
    import random

    from services.task.spec import task_from_id
    from services.task.tool_demos import run_claude_code_demo

    passed = 0
    for n, tid in enumerate(ids):
        task = task_from_id(tid)
        env = run_claude_code_demo(task, client, codec=codec, fix_turns=1,  # type: ignore[arg-type]
                                   max_turns=6 * sum(len(m.steps) + 2 for m in task.modules), rng=random.Random(n),
                                   temperature=0.0, execution_id=f"heldout-{n}")
        passed += all(env.module_passed.get(m.name) for m in task.modules)
    return passed / len(ids)


if __name__ == "__main__":
    main()

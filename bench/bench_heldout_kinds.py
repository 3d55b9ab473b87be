"""Which modules hold a policy's held-out pass rate back: first-attempt accuracy per module kind.

    .venv/bin/python -m bench.bench_heldout_kinds [--tasks 128] [--checkpoint PATH ...] [--out FILE]

Writes bench/results/heldout_kinds_run.md (the findings so far are in heldout_kinds.md).

A job's pass rate counts a task as passed when its reward is 1.0, which with the default scorer
means every module right on its first attempt (services.task.scoring). This bench runs the default
job's held-out tasks (deploy/config/job.toml's task knobs, run.toml's harness knobs, greedy, the
built-in agent in-process on one thread) with the warm-started built-in model and with each
``--checkpoint`` (the policy directory `gyre run` writes, ``<report dir>/policy``, a trainer
checkpoint directory ``.../checkpoints/<job>/step-00000N`` or a ``model.safetensors``:
RL-trained weights of the same model), and writes, per policy, the pass rate
on the short and the long tasks, their mean reward, and the share of modules right the first time per kind
(`services.task.scoring.MODULE_KINDS`): a call to an earlier module, a ``sub`` step, an ``rsub``
step, only ``add`` / ``mul``. The warm start is the baseline of the same run.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.task.agent import AgentConfig

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "heldout_kinds_run.md"  # the last run's table; heldout_kinds.md has the findings


def default_job_knobs() -> tuple[dict[str, str], AgentConfig]:
    """The default job's task params (its job file) and the built-in harness's agent (run.toml's
    ``[harness]``), through the loaders the job and the harness use."""
    from services.common.config import load_config
    from services.harness.config import HarnessConfig
    from services.scheduler.jobfile import load_job

    job = load_job(ROOT / "deploy" / "config" / "job.toml")
    harness = load_config(HarnessConfig, path=ROOT / "deploy" / "config" / "run.toml", section="harness")
    return dict(job.tasks.params), harness.agent


def load_policy(base: Path, checkpoint: str | None) -> Any:
    """The built-in model from ``base``, with a trainer checkpoint's weights if one is given."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base))
    if checkpoint:
        from services.trainer.checkpoint import load_weights

        path = Path(checkpoint)
        if (path / "COMPLETE").is_file():  # a trainer checkpoint (DCP, any number of ranks)
            model.load_state_dict(load_weights(path), strict=True)
            return model.eval()
        path = path / "model.safetensors" if path.is_dir() else path
        if not path.is_file():
            raise SystemExit(f"no checkpoint weights at {path}: pass a policy directory, a trainer checkpoint "
                             "directory or a model.safetensors")
        model.load_state_dict(load_file(str(path)), strict=True)
    return model.eval()


def measure(model: Any, codec: Any, n: int, params: dict[str, str], agent: AgentConfig) -> dict[str, Any]:
    from services.task.agent import run_execution
    from services.task.local_client import LocalModelClient
    from services.task.scoring import MODULE_KINDS, first_attempt_by_kind, score_workspace
    from services.task.spec import heldout_tasks, task_from_id

    client = LocalModelClient(model, keep_records=False)
    cfg = replace(agent, temperature=0.0)
    lengths = {"short": [0, 0], "long": [0, 0]}
    rewards = {"short": 0.0, "long": 0.0}
    kinds = {k: [0, 0] for k in MODULE_KINDS}
    short_modules = int(params.get("num_modules", "4"))
    t0 = time.perf_counter()
    for payload in heldout_tasks(params, n):
        task = task_from_id(json.loads(payload)["task_id"])
        res = run_execution(task, client, codec=codec, config=cfg, execution_id=task.task_id)
        score = score_workspace(task, res.files)
        length = "long" if len(task.modules) > short_modules else "short"
        row = lengths[length]
        rewards[length] += score.reward
        row[0] += 1
        row[1] += int(score.reward >= 1.0 - 1e-9)
        for kind, (total, ok) in first_attempt_by_kind(task, score).items():
            kinds[kind][0] += total
            kinds[kind][1] += ok
    return {"lengths": lengths, "rewards": rewards, "kinds": kinds, "tasks": n, "wall_s": time.perf_counter() - t0}


def table(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    from services.task.scoring import MODULE_KINDS

    def frac(pair: list[int]) -> str:
        return f"{pair[1] / pair[0]:.3f} ({pair[0]})" if pair[0] else "-"

    first = rows[0][1]
    def mean(r: dict[str, Any], length: str) -> str:
        count = r["lengths"][length][0]
        return f"{r['rewards'][length] / count:.3f}" if count else "-"

    head = ["policy", "pass rate, all", "short tasks", "long tasks", "short tasks' mean reward",
            "long tasks' mean reward",
            *[f"{k} modules right first time" for k in MODULE_KINDS], "wall s"]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name, r in rows:
        both = [sum(v[0] for v in r["lengths"].values()), sum(v[1] for v in r["lengths"].values())]
        out.append("| " + " | ".join([name, frac(both), frac(r["lengths"]["short"]), frac(r["lengths"]["long"]),
                                      mean(r, "short"), mean(r, "long"),
                                      *[frac(r["kinds"][k]) for k in MODULE_KINDS], f"{r['wall_s']:.0f}"]) + " |")
    out += ["", f"Counts in brackets: tasks or modules. {first['tasks']} held-out tasks, greedy; a pass is reward "
                "1.0 (every module right on its first attempt); a task's reward is its modules' test-weighted credit, "
                "a module fixed after a failing report earning at most half (services.task.scoring)."]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=128, help="held-out tasks (the default job evaluates 128)")
    ap.add_argument("--checkpoint", action="append", default=[], help="gyre run's policy dir, a trainer checkpoint dir or a model.safetensors")
    ap.add_argument("--out", default=str(RESULTS), help="markdown file to write")
    args = ap.parse_args(argv)
    if args.tasks < 1:
        raise SystemExit("--tasks must be >= 1")

    import torch

    from services.task.model import ensure_builtin_model
    from services.task.tokenizer import Codec

    torch.set_num_threads(1)
    base = ensure_builtin_model(ROOT / ".gyre" / "models")
    codec = Codec.from_dir(base)
    params, agent = default_job_knobs()
    rows = []
    for name, ckpt in [("warm-started built-in (baseline)", None), *[(c, c) for c in args.checkpoint]]:
        rows.append((name, measure(load_policy(base, ckpt), codec, args.tasks, params, agent)))
        print(rows[-1][0], rows[-1][1], flush=True)
    lines = ["# Held-out first-attempt accuracy per module kind", "",
             f"`python -m bench.bench_heldout_kinds --tasks {args.tasks}"
             + "".join(f" --checkpoint {c}" for c in args.checkpoint) + "`; the default job's held-out tasks "
             f"({', '.join(f'{k}={v}' for k, v in params.items() if k not in ('split', 'start_seed'))}; harness "
             f"context_limit_tokens={agent.context_limit_tokens}, fix_turns={agent.fix_turns}, retries={agent.retries}).",
             "", *table(rows), ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

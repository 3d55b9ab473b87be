"""``gyre replay --records FILE.jsonl``: train on recorded TITO executions, no engine.

Executions recorded elsewhere (another harness, production traffic, a trace of a 64K-deep agent)
train through the real trajectory and trainer services, which this command starts in a data
directory of its own and stops afterwards, as ``gyre run`` does::

    read + validate the JSONL (DESIGN.md format; a bad line: one sentence naming it, nothing starts)
    up: redis, trajectory (--max-paths), trainer
    trainer.StartJob(source=trajectory, num_steps=N)
    for each step:
        trajectory.OpenStep -> IngestRecords (every call, ids suffixed per step) -> CompleteExecution
        (each execution's status and reward) -> CloseStep;  trainer.WaitStep
        print one JSON line: trainable / trained tokens, the tokens the trainer processed against the
        trees' and the paths' (``processed_tokens``, ``tree_tokens``, ``naive_tokens``), loss, peak RSS
        of each service (and of each rank of a sharded trainer group: ``trainer/0``, ``trainer/1``, ...)
    down

Every step replays the whole file (new execution ids per step: a packed execution takes no more
records), as ``--steps`` epochs over it; weight versions are the step's, so the recorded
log-probabilities are the behaviour policy's. A call whose prompt diverges from the earlier calls
is a new branch of its execution's tree, never an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

USAGE = ("gyre replay --records FILE.jsonl [--max-paths N] [--steps N] [--model SPEC] [--token-budget N] "
         "[--tree-split pieces|context] [--shards N]\n"
         "       gyre replay --trace FILE.jsonl [--time-scale X] ...  (a trace on the live stack: gyre replay "
         "--trace x --help)")


def _peak_rss_mib(pid: int) -> float | None:
    """The process's peak resident set (VmHWM), MiB; None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def replay_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="gyre replay", usage=USAGE, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", required=True, help="TITO records, JSONL (DESIGN.md format)")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps; each replays the whole file")
    p.add_argument("--max-paths", type=int, default=0, help="root-to-leaf paths kept per execution (0: all)")
    p.add_argument("--model", default="builtin-tiny", help="the policy to train (a name or checkpoint directory)")
    p.add_argument("--token-budget", type=int, default=16384, help="micro-batch size, tokens")
    p.add_argument("--kv-budget-tokens", type=int, default=0,
                   help="pieces: the largest tree trained whole (keys/values kept); larger ones are cut into chunks "
                        "of at most this many tokens with their root paths recomputed as context (0: no limit)")
    p.add_argument("--tree-split", choices=("pieces", "context"), default="pieces",
                   help="a tree larger than the budget: the whole tree in DFS pieces with kept keys/values (each "
                        "token computed once), or DFS chunks with their root paths copied as context")
    p.add_argument("--shards", type=int, default=1,
                   help="ranks of the trainer group that shard the model, gradients and optimizer state (FSDP2)")
    p.add_argument("--chunk-tokens", type=int, default=8192,
                   help="largest forward, tokens: longer micro-batches train in chunks with the exact gradient")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute decoder-layer activations in the backward (less memory per token)")
    p.add_argument("--data-dir", default="", help="where the services keep their state (default: a temp dir)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="longest wait for one step")
    args = p.parse_args(list(argv))
    for name, value, least in (("--steps", args.steps, 1), ("--max-paths", args.max_paths, 0),
                               ("--token-budget", args.token_budget, 1), ("--shards", args.shards, 1),
                               ("--chunk-tokens", args.chunk_tokens, 0), ("--kv-budget-tokens", args.kv_budget_tokens, 0)):
        if value < least:
            print(f"gyre replay: {name} must be at least {least}, got {value}", file=sys.stderr)
            return 2

    from services.trajectory.records import read_jsonl_file

    try:
        calls, executions = read_jsonl_file(args.records)
        if not calls:
            raise ValueError("it holds no model call")
        unscored = [e.execution_id for e in executions.values() if e.reward is None]
        if unscored:
            raise ValueError(f"execution {unscored[0]!r} has no reward (give it a reward field, on an execution "
                             f"line or its last call){f' (and {len(unscored) - 1} more)' if len(unscored) > 1 else ''}")
    except ValueError as exc:
        print(f"gyre replay: {args.records}: {exc}", file=sys.stderr)
        return 2
    return _replay(args, calls, executions)


def _replay(args: argparse.Namespace, calls: list[Any], executions: dict[str, Any]) -> int:
    from services.launcher import Launcher, default_specs
    from services.run import DEFAULT_RUN_CONFIG
    from services.trainer.client import TrainerClient
    from services.trainer.job import TrainerJob
    from services.trajectory.client import TrajectoryClient
    from services.trajectory.records import Outcome, Status

    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="gyre-replay-"))
    specs = {s.name: s for s in default_specs(0)}
    trajectory = dataclasses.replace(specs["trajectory"], extra=("--max-paths", str(args.max_paths),
                                                                 "--tree-split", args.tree_split,
                                                                 "--kv-budget-tokens", str(args.kv_budget_tokens)))
    launcher = Launcher(data_dir, Path(DEFAULT_RUN_CONFIG))
    job_id = f"replay-{int(time.time())}"
    say = lambda m: print(m, file=sys.stderr)  # noqa: E731  (stdout carries only the JSON lines)
    try:
        up = launcher.up([trajectory, specs["trainer"]], echo=say)
        traj = TrajectoryClient(up["trajectory"].address)
        trainer = TrainerClient(up["trainer"].address)
        trainer.start_job(TrainerJob(job_id=job_id, model=args.model, source="trajectory",
                                     trajectory_address=up["trajectory"].address, num_steps=args.steps,
                                     activation_checkpointing=args.activation_checkpointing, shards=args.shards,
                                     chunk_tokens=args.chunk_tokens))
        groups = {eid: e.group_id or eid for eid, e in executions.items()}
        for step in range(args.steps):
            t0 = time.perf_counter()
            suffix = f"@{step}"
            traj.open_step(job_id, step, num_executions=len(executions), token_budget=args.token_budget)
            traj.ingest([dataclasses.replace(c, execution_id=c.execution_id + suffix, job_id=job_id,
                                             weight_version=step) for c in calls])
            for eid, e in executions.items():
                traj.complete_execution(Outcome(eid + suffix, groups[eid] + suffix, e.status or Status.FINISHED,
                                                e.reward, step=step, job_id=job_id))
            traj.close_step(job_id, step)
            report = trainer.wait_step(step, timeout_s=args.timeout_s)
            stats = [traj.execution_stats(eid + suffix, job_id=job_id) for eid in executions]
            metrics = dict(report.metrics)
            peak = {name: _peak_rss_mib(r.pid) for name, r in up.items()}
            # a sharded group's ranks (rank 0 is the trainer service itself), as the trainer measured them
            peak.update({f"trainer/{r}": round(metrics[f"peak_rss_mib_rank{r}"], 1) for r in range(args.shards)
                         if f"peak_rss_mib_rank{r}" in metrics})
            print(json.dumps({
                "step": step, "executions": len(executions),
                "trainable_tokens": sum(s.trainable_tokens for s in stats),
                "trained_tokens": int(metrics.get("num_targets", 0)),
                "processed_tokens": int(metrics.get("tokens", 0)),  # every forward's tokens, context copies included
                "tree_tokens": sum(s.tree_tokens for s in stats), "naive_tokens": sum(s.naive_tokens for s in stats),
                "loss": metrics.get("loss"), "seconds": round(time.perf_counter() - t0, 2),
                "peak_rss_mib": peak}), flush=True)
        trainer.stop_job(job_id)
        return 0
    except Exception as exc:  # deliberate: one sentence, and the services go down below
        print(f"gyre replay: {type(exc).__name__}: {exc} (service logs in {data_dir / 'logs'})", file=sys.stderr)
        return 1
    finally:
        launcher.down(echo=lambda _m: None)


__all__ = ["replay_main"]

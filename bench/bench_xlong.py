"""XLong on the live stack: one agent execution of many calls and tokens, played by
``gyre replay --trace`` through every service and trained on in the same job.

    .venv/bin/python -m bench.bench_xlong          # short: ~120K tokens, ~70 calls (a few minutes)
    .venv/bin/python -m bench.bench_xlong --full   # >= 1M tokens, >= 500 calls (about 20 minutes on 2 cores)
    .venv/bin/python -m bench.bench_xlong --wide   # 16 executions of 64K tokens at once, one step

The execution (``agent_trace``): a main agent whose turns append a tool result and generate a
reply; every 5th main turn a sub-agent of its own (3 turns); when the main context passes
``context_cap`` tokens a summarizer compacts it to the system prompt plus its summary. Every
context stays under the built-in model's 65,536 positions; the execution's tokens add up past
them. Writes bench/results/xlong.md (``--full``), xlong-wide.md (``--wide``) or xlong-short.md: wall time,
calls, tokens, prefilled / unique tokens, and each service's RSS: after start-up, peak, and at
the end of the job (the execution's state released: back near its start).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_TOKENS = 32  # services/task/families/trace.py


def agent_trace(*, tokens: int, tool_tokens: int, gen_tokens: int, context_cap: int, summary_tokens: int,
                sub_every: int = 5, sub_turns: int = 3) -> tuple[list[dict], dict[str, int]]:
    """Turns of one execution of about ``tokens`` tokens, and its counts (calls, unique tokens)."""
    turns: list[dict] = []
    main, total, unique, main_turns, subs = SYSTEM_TOKENS, 0, SYSTEM_TOKENS, 0, 0
    while total < tokens:
        turns.append({"prompt_tokens": tool_tokens, "gen_tokens": gen_tokens, "env_s": 0.0})
        main += tool_tokens + gen_tokens
        total += tool_tokens + gen_tokens
        unique += tool_tokens + gen_tokens
        main_turns += 1
        if main_turns % sub_every == 0:
            subs += 1
            unique += SYSTEM_TOKENS
            for _ in range(sub_turns):
                turns.append({"prompt_tokens": tool_tokens, "gen_tokens": gen_tokens, "env_s": 0.0,
                              "agent": f"sub-{subs}", "role": "subagent"})
                total += tool_tokens + gen_tokens
                unique += tool_tokens + gen_tokens
        if main + tool_tokens + gen_tokens > context_cap:
            turns.append({"prompt_tokens": 64, "gen_tokens": summary_tokens, "env_s": 0.0, "agent": "compactor",
                          "role": "summary", "compact_to": summary_tokens})
            total += 64 + summary_tokens
            unique += 64 + summary_tokens + SYSTEM_TOKENS + summary_tokens  # the compacted main context again
            main = SYSTEM_TOKENS + summary_tokens
    calls = sum(1 for t in turns if t["gen_tokens"] > 0)
    return turns, {"calls": calls, "turns": len(turns), "tokens": total, "unique_tokens": unique}


class RssSampler(threading.Thread):
    """Every ``period_s``: each service's resident set (VmRSS) and peak (VmHWM), from the pids the
    launcher records in ``<data>/run/state.json``."""

    def __init__(self, state_file: Path, period_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.state_file, self.period_s = state_file, period_s
        self.stop = threading.Event()
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.peak: dict[str, float] = {}

    def run(self) -> None:
        while not self.stop.wait(self.period_s):
            try:
                state = json.loads(self.state_file.read_text())
            except (OSError, ValueError):
                continue
            pids = {name: s["pid"] for name, s in state.get("services", {}).items()}
            if state.get("redis") and state["redis"].get("pid"):
                pids["redis"] = state["redis"]["pid"]
            for name, pid in pids.items():
                rss, hwm = _mem(pid)
                if rss is None:
                    continue
                self.first.setdefault(name, rss)
                self.last[name] = rss
                self.peak[name] = max(self.peak.get(name, 0.0), hwm or rss)


def _mem(pid: int) -> tuple[float | None, float | None]:
    rss = hwm = None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024
    except OSError:
        return None, None
    return rss, hwm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the >= 1M-token, >= 500-call execution")
    parser.add_argument("--wide", action="store_true",
                        help="16 concurrent executions of 64K tokens each in one step")
    args = parser.parse_args()
    executions, env = 1, dict(os.environ)
    if args.full:
        turns, counts = agent_trace(tokens=1_000_000, tool_tokens=1_400, gen_tokens=32, context_cap=28_000,
                                    summary_tokens=256)
        out, budget = ROOT / "bench" / "results" / "xlong.md", 3 * 3600
    elif args.wide:
        turns, counts = agent_trace(tokens=64_000, tool_tokens=1_400, gen_tokens=32, context_cap=24_000,
                                    summary_tokens=256)
        out, budget, executions = ROOT / "bench" / "results" / "xlong-wide.md", 3 * 3600, 16
        # the engines hold 8 running contexts of up to 24K each (the default budget is one 64K context)
        env["GYRE_ENGINE_KV_CAPACITY_TOKENS"] = str(8 * 32_768)
    else:
        turns, counts = agent_trace(tokens=120_000, tool_tokens=1_400, gen_tokens=32, context_cap=12_000,
                                    summary_tokens=128)
        out, budget = ROOT / "bench" / "results" / "xlong-short.md", 1800
    with tempfile.TemporaryDirectory(prefix="gyre-bench-xlong-") as d:
        work = Path(d)
        trace = work / "xlong.jsonl"
        trace.write_text("".join(json.dumps({"step": 0, "group": f"x{i}", "execution_id": f"x{i}", "turns": turns})
                                 + "\n" for i in range(executions)))
        sampler = RssSampler(work / "data" / "elastic" / "run" / "state.json")
        sampler.start()
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "services.cli", "replay", "--trace", str(trace), "--quiet", "true",
                               "--data-dir", str(work / "data"), "--report-dir", str(work / "report"),
                               "--time-budget-s", str(budget), "--harness-concurrency", str(max(2, executions))],
                              cwd=ROOT, capture_output=True, text=True, timeout=budget + 600, env=env)
        wall = time.perf_counter() - t0
        sampler.stop.set()
        if proc.returncode != 0:
            raise SystemExit(f"gyre replay failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        reuse = next((x for x in proc.stdout.splitlines() if x.startswith("prefix reuse:")), "")
        nums = [float(w.replace(",", "")) for w in reuse.split()[2:5] if w.replace(",", "").isdigit()]
        cached, prompt = (nums[0], nums[1]) if len(nums) >= 2 else (0.0, 0.0)
        logs = work / "data" / "elastic" / "logs"
        ended = [json.loads(x) for x in (logs / "harness.log").read_text().splitlines() if '"execution ended"' in x]
        refused = sum(1 for x in (logs / "trajectory.log").read_text().splitlines() if "rpc rejected" in x)
    statuses = sorted({str(e.get("status", "?")) for e in ended}) or ["?"]
    calls_made = sum(int(e.get("calls", 0)) for e in ended)
    prefilled = prompt - cached
    unique = counts["unique_tokens"] * executions
    flag = " --full" if args.full else " --wide" if args.wide else ""
    what = ("One agent execution" if executions == 1 else
            f"{executions} agent executions at once, in one step, each of {counts['tokens']:,} tokens,")
    lines = [f"# XLong on the live stack (bench/bench_xlong.py{flag})", "",
             f"{what} played by `gyre replay --trace` through every service (engines, gateway, "
             "scheduler, harness, reward, trajectory, trainer: real processes, the built-in model, 2 CPU cores) "
             "and trained on in the same job. A main agent appending 1,400-token tool results and generating "
             "32 tokens a turn, a 3-turn sub-agent every 5th main turn, and a compaction whenever the main "
             "context would pass the cap (every context stays under the model's 65,536 positions).", "",
             "| | |", "| --- | --- |",
             f"| state | {summary['state']} ({', '.join(statuses)}; {len(ended)} of {executions} executions ended) |",
             f"| wall time | {wall:,.0f} s (job {summary['wall_s']:,.0f} s) |",
             f"| model calls | {calls_made:,} of {counts['calls'] * executions:,} in the trace "
             f"({counts['turns'] * executions:,} turns) |",
             f"| execution tokens (appended + generated) | {counts['tokens'] * executions:,} |",
             f"| prompt tokens sent | {prompt:,.0f} |",
             f"| prefilled (not from the prefix cache) | {prefilled:,.0f} |",
             f"| unique context tokens | {unique:,} |",
             f"| prefilled / unique | **{prefilled / max(unique, 1):.3f}** |",
             f"| trained tokens | {summary['trained_tokens']:,} |",
             f"| TITO records refused by trajectory | {refused} |", "",
             "| service | RSS after start MiB | peak RSS MiB | RSS at the end MiB |", "| --- | --- | --- | --- |"]
    for name in sorted(sampler.peak):
        lines.append(f"| {name} | {sampler.first[name]:.0f} | {sampler.peak[name]:.0f} | {sampler.last[name]:.0f} |")
    lines += ["", "RSS sampled every second from /proc (VmRSS; peak = VmHWM) by pid from the launcher's state; "
              "'at the end' is the last sample before the stack went down, after the execution's outcome was "
              "trained on. Prefilled / unique counts every context token an engine computed over unique context "
              "tokens (system prompts of new contexts and the compacted summaries count as unique).", ""]
    out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

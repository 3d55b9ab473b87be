"""Run report: ``report.html`` + PNG figures + ``metrics.jsonl`` for one `gyre run`.

Inputs are plain records so any run (elastic, colocate, async, a comparison) can be reported:
- ``steps``: one dict per step: ``step``, ``time_s`` (since start), ``train_pass_rate``,
  optional ``heldout_pass_rate``, ``naive_tokens``, ``tree_tokens``, ``timeouts`` and
  ``timeout_reward``, ``execution_calls`` / ``execution_tokens`` (one entry per execution) and any
  other scalars;
- ``evals``: ``{"step", "time_s", "heldout_pass_rate"}`` (held-out, greedy);
- ``roles``: cell role intervals ``{"cell_id", "role", "start_s", "end_s"}`` (Gantt);
- ``switches``: ``{"cell_id", "from", "to", "duration_s", "at_s", "migrated"}``;
- ``meta``: mode, seed, hardware, config — shown at the top.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROLE_COLORS = {"rollout": "#4C72B0", "train": "#DD8452", "switching": "#C44E52", "idle": "#BBBBBB"}


def write_report(out_dir: str | Path, *, steps: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]],
                 roles: Sequence[Mapping[str, Any]], switches: Sequence[Mapping[str, Any]],
                 meta: Mapping[str, Any]) -> Path:
    """Write the report directory; returns the path of report.html."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "w") as fh:
        for rec in steps:
            fh.write(json.dumps({"kind": "step", **rec}) + "\n")
        for rec in evals:
            fh.write(json.dumps({"kind": "eval", **rec}) + "\n")
        for rec in switches:
            fh.write(json.dumps({"kind": "switch", **rec}) + "\n")
        for rec in roles:
            fh.write(json.dumps({"kind": "role", **rec}) + "\n")
    figures: list[tuple[str, str]] = []

    fig, ax = plt.subplots(figsize=(7, 3.6))
    if steps:
        ax.plot([s["step"] for s in steps], [s.get("train_pass_rate", float("nan")) for s in steps], "o-",
                label="train (sampled)")
    if evals:
        ax.plot([e["step"] for e in evals], [e["heldout_pass_rate"] for e in evals], "s-", label="held-out (greedy)")
    ax.set_xlabel("step")
    ax.set_ylabel("pass rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Learning curve")
    fig.tight_layout()
    fig.savefig(out / "learning_curve.png", dpi=110)
    plt.close(fig)
    figures.append(("learning_curve.png", "Pass rate per step: training executions and held-out tasks."))

    cells = sorted({r["cell_id"] for r in roles})
    fig, ax = plt.subplots(figsize=(9, 0.5 * max(len(cells), 2) + 1.2))
    for i, cell in enumerate(cells):
        for r in roles:
            if r["cell_id"] == cell:
                ax.barh(i, r["end_s"] - r["start_s"], left=r["start_s"], height=0.6,
                        color=ROLE_COLORS.get(r["role"], "#888888"))
    ax.set_yticks(range(len(cells)), cells)
    ax.set_xlabel("seconds since start")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ROLE_COLORS.values()]
    ax.legend(handles, list(ROLE_COLORS), loc="upper right", ncols=4, fontsize=8)
    ax.set_title("Cell roles over time")
    fig.tight_layout()
    fig.savefig(out / "cell_timeline.png", dpi=110)
    plt.close(fig)
    figures.append(("cell_timeline.png", "Every cell's role over time (Gantt)."))

    fig, ax = plt.subplots(figsize=(7, 3.2))
    xs = [s["step"] for s in steps]
    ax.bar([x - 0.27 for x in xs], [s.get("naive_tokens", 0) for s in steps], width=0.27, label="naive (per path)")
    ax.bar(xs, [s.get("tree_tokens", 0) for s in steps], width=0.27, label="tree")
    ax.bar([x + 0.27 for x in xs], [s.get("processed_tokens", 0) for s in steps], width=0.27,
           label="processed (trainer forwards)")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens")
    ax.legend()
    ax.set_title("Tokens: naive path expansion, prefix-sharing tree, what the trainer processed")
    fig.tight_layout()
    fig.savefig(out / "tokens.png", dpi=110)
    plt.close(fig)
    figures.append(("tokens.png", "Tokens per step if every path were trained separately, in the prefix-sharing "
                                  "tree, and what the trainer's forwards processed (the tree plus any context copies)."))

    fig, ax = plt.subplots(figsize=(7, 3.2))
    for direction, color in (("rollout->train", "#DD8452"), ("train->rollout", "#4C72B0")):
        ds = [s["duration_s"] for s in switches if f"{s['from']}->{s['to']}" == direction]
        if ds:
            ax.hist(ds, bins=min(20, max(3, len(ds))), alpha=0.7, color=color, label=f"{direction} (n={len(ds)})")
    ax.set_xlabel("switch duration, s")
    ax.set_ylabel("count")
    if switches:
        ax.legend()
    ax.set_title("Role switch durations")
    fig.tight_layout()
    fig.savefig(out / "switch_durations.png", dpi=110)
    plt.close(fig)
    figures.append(("switch_durations.png", "Duration of each role switch, by direction."))

    if any("step_time_s" in s for s in steps):
        # the trainer core's step: waiting for the step's rollouts (its tail), training, the
        # all-reduce, the update + weights published to the engines
        parts = (("waiting for rollouts", "#BBBBBB", lambda r: r.get("train_time_s", 0.0) - r.get("compute_s", 0.0)),
                 ("training", "#DD8452", lambda r: r.get("compute_s", 0.0)),
                 ("all-reduce", "#55A868", lambda r: r.get("allreduce_s", 0.0)),
                 ("update + publish", "#4C72B0", lambda r: r.get("step_time_s", 0.0) - r.get("train_time_s", 0.0)
                  - r.get("allreduce_s", 0.0)))
        fig, ax = plt.subplots(figsize=(9, 3.2))
        bottom = [0.0] * len(steps)
        switching = any("switch_cell_s" in r for r in steps)
        width = 0.4 if switching else 0.8
        core_x = [x - width / 2 for x in xs] if switching else xs
        for label, color, part in parts:
            heights = [max(part(r), 0.0) for r in steps]
            ax.bar(core_x, heights, width=width, bottom=bottom, color=color, label=label)
            bottom = [b + h for b, h in zip(bottom, heights)]
        if switching:  # beside it: what the cells spent switching roles during the step
            ax.bar([x + width / 2 for x in xs], [r.get("switch_cell_s", 0.0) for r in steps], width=width,
                   color="#C44E52", hatch="//", label="switching (cell-seconds, all cells)")
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.set_title("Trainer step time")
        fig.tight_layout()
        fig.savefig(out / "step_time.png", dpi=110)
        plt.close(fig)
        figures.append(("step_time.png", "The trainer core's step time: waiting for the step's rollouts, training "
                                         "(its own micro-batches), the all-reduce with replicas, update and publish; "
                                         "beside it, the cell-seconds spent switching roles during the step."))
    calls = [c for s in steps for c in s.get("execution_calls", [])]
    tokens = [t for s in steps for t in s.get("execution_tokens", [])]
    if calls:
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
        left.hist(calls, bins=min(30, max(3, len(set(calls)))), color="#4C72B0")
        left.set_xlabel("model calls per execution")
        left.set_ylabel("executions")
        right.hist(tokens, bins=30, color="#DD8452")
        right.set_xlabel("tokens per execution (unique)")
        fig.suptitle("Executions: calls and tokens")
        fig.tight_layout()
        fig.savefig(out / "executions.png", dpi=110)
        plt.close(fig)
        figures.append(("executions.png", "Distribution of model calls and of tokens per training execution."))
    if any("timeouts" in s for s in steps):
        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.bar(xs, [s.get("timeouts", 0) for s in steps], color="#C44E52", label="timed-out executions")
        ax.set_xlabel("step")
        ax.set_ylabel("executions")
        twin = ax.twinx()
        twin.plot(xs, [s.get("timeout_reward", float("nan")) for s in steps], "o-", color="#333333",
                  label="their mean partial reward")
        twin.set_ylim(0, 1)
        twin.set_ylabel("partial reward")
        ax.set_title("Timeouts and their partial rewards per step")
        fig.tight_layout()
        fig.savefig(out / "timeouts.png", dpi=110)
        plt.close(fig)
        figures.append(("timeouts.png", "Executions that hit their deadline per step, and the mean reward they were "
                                        "scored with from their workspace."))

    summary = _summary(steps, evals, switches)
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                   for k, v in {**meta, **summary}.items())
    imgs = "".join(f'<figure><img src="{f}" alt="{html.escape(c)}"><figcaption>{html.escape(c)}</figcaption></figure>'
                   for f, c in figures)
    why = "".join(f"<tr><td>{float(s.get('at_s', 0.0)):.0f}</td><td>{html.escape(str(s.get('cell_id', '')))}</td>"
                  f"<td>{html.escape(str(s.get('from', '')))} -&gt; {html.escape(str(s.get('to', '')))}</td>"
                  f"<td>{float(s.get('duration_s', 0.0)):.2f}</td><td>{html.escape(str(s.get('reason') or '-'))}</td></tr>"
                  for s in switches)
    if why:  # every switch with the policy's reason for it (elastic: what it weighed)
        imgs += ("<h2>Role switches and why</h2><table><tr><th>at s</th><th>cell</th><th>switch</th>"
                 f"<th>took s</th><th>reason</th></tr>{why}</table>")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>Gyre run report</title>
<style>body{{font-family:sans-serif;max-width:980px;margin:2em auto}}table{{border-collapse:collapse}}
th,td{{border:1px solid #ccc;padding:4px 8px;text-align:left}}img{{max-width:100%}}</style></head><body>
<h1>Gyre run report</h1><table>{rows}</table>{imgs}
<p>Raw data: <a href="metrics.jsonl">metrics.jsonl</a></p></body></html>"""
    (out / "report.html").write_text(page)
    return out / "report.html"


def _summary(steps: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]],
             switches: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": len(steps)}
    if evals:
        out["held-out pass rate (first -> last)"] = (
            f"{evals[0]['heldout_pass_rate']:.3f} -> {evals[-1]['heldout_pass_rate']:.3f}")
    naive = sum(s.get("naive_tokens", 0) for s in steps)
    tree = sum(s.get("tree_tokens", 0) for s in steps)
    if tree:
        out["tokens naive / tree"] = f"{naive} / {tree} ({naive / tree:.2f}x)"
        processed = sum(s.get("processed_tokens", 0) for s in steps)
        if processed:
            out["tokens processed / tree"] = f"{processed:.0f} / {tree} ({processed / tree:.2f}x)"
    for direction in ("rollout->train", "train->rollout"):
        ds = [s["duration_s"] for s in switches if f"{s['from']}->{s['to']}" == direction]
        if ds:
            out[f"switch {direction}"] = f"n={len(ds)}, mean {sum(ds) / len(ds):.2f}s, max {max(ds):.2f}s"
    calls = [c for s in steps for c in s.get("execution_calls", [])]
    if calls:
        tokens = [t for s in steps for t in s.get("execution_tokens", [])]
        out["per execution"] = (f"{sum(calls) / len(calls):.1f} calls (max {max(calls)}), "
                                f"{sum(tokens) / max(len(tokens), 1):,.0f} tokens (max {max(tokens, default=0):,})")
    timeouts = sum(s.get("timeouts", 0) for s in steps)
    if timeouts:
        partial = [s["timeout_reward"] * s["timeouts"] for s in steps if "timeout_reward" in s]
        out["timed out"] = f"{timeouts} executions, mean partial reward {sum(partial) / timeouts:.3f}"
    if steps:
        out["wall-clock"] = f"{steps[-1].get('time_s', 0):.0f}s"
    return out

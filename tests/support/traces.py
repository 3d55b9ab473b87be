"""Small agent-shaped scheduler traces (the replay extension: sub-agents, a compaction)."""

from __future__ import annotations

import json
from pathlib import Path


def agent_turns(scale: int = 1) -> list[dict]:
    """A main agent, a sub-agent call, a compaction and a tool turn without a model call."""
    return [{"prompt_tokens": 60 * scale, "gen_tokens": 12, "env_s": 0.05},
            {"prompt_tokens": 40 * scale, "gen_tokens": 8, "env_s": 0.0, "agent": "search", "role": "subagent"},
            {"prompt_tokens": 30 * scale, "gen_tokens": 10, "env_s": 0.05},
            {"prompt_tokens": 20, "gen_tokens": 16, "env_s": 0.0, "agent": "compactor", "role": "summary",
             "compact_to": 12},
            {"prompt_tokens": 50 * scale, "gen_tokens": 10, "env_s": 0.05},
            {"prompt_tokens": 30, "gen_tokens": 0, "env_s": 0.0}]


def write_trace(path: Path, *, steps: int = 2, per_step: int = 2, turns: list[dict] | None = None) -> Path:
    rows = [{"step": s, "group": f"s{s}-g{i}", "execution_id": f"s{s}-e{i}", "turns": turns or agent_turns()}
            for s in range(steps) for i in range(per_step)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path

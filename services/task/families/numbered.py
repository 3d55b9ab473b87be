"""``numbered``: one JSON payload ``{"step": s, "group": g, "index": s * groups + g}`` per group.

For tests and demos: it has no scorer and no harness runner, so nothing but the scheduler uses it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from services.task.registry import TaskFamily


def generate(params: Mapping[str, str], step: int, groups: int) -> list[bytes]:
    if params:
        raise ValueError(f"generator 'numbered' takes no params, got {sorted(params)}")
    return [json.dumps({"step": step, "group": g, "index": step * groups + g}).encode() for g in range(groups)]


FAMILY = TaskFamily(name="numbered", generator="services.task.families.numbered:generate")

"""Group-relative advantages (GRPO): one scalar per execution, broadcast to its trainable tokens.

``advantage = reward - mean(rewards of the group)``, optionally divided by the group's standard
deviation (population std, plus ``eps``). Only *trained* executions take part: excluded ones and
ones without a reward are dropped; timed-out executions count with their partial reward.
A group of one trained execution has advantage 0 (no baseline to compare against).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from services.trajectory.records import Outcome


def group_advantages(rewards: Mapping[str, float], *, normalize_std: bool = False,
                     eps: float = 1e-6) -> dict[str, float]:
    """Advantages of one group from ``{execution_id: reward}``."""
    if not rewards:
        return {}
    ids = list(rewards)
    r = np.asarray([rewards[i] for i in ids], dtype=np.float64)
    if not np.isfinite(r).all():
        raise ValueError("group rewards must be finite numbers")
    adv = r - r.mean()
    if normalize_std:
        adv = adv / (r.std() + eps)
    return {i: float(a) for i, a in zip(ids, adv, strict=True)}


def outcome_advantages(outcomes: Iterable[Outcome], *, normalize_std: bool = False,
                       eps: float = 1e-6) -> dict[str, float]:
    """Advantages of every trained execution among ``outcomes``, grouped by ``group_id``."""
    groups: dict[str, dict[str, float]] = {}
    for o in outcomes:
        if o.trained:
            assert o.reward is not None
            groups.setdefault(o.group_id, {})[o.execution_id] = o.reward
    out: dict[str, float] = {}
    for rewards in groups.values():
        out.update(group_advantages(rewards, normalize_std=normalize_std, eps=eps))
    return out

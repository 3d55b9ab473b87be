"""Entry-point scorer for reliability tests: the fraction of ``PARTS`` parts present in the
workspace (``part-1.txt`` ... ``part-4.txt``), so a preserved partial workspace scores partially."""

from __future__ import annotations

PARTS = 4


def fraction_done(files: dict[str, bytes], task_id: str, status: str) -> dict[str, float | int]:
    done = sum(1 for i in range(1, PARTS + 1) if f"part-{i}.txt" in files)
    return {"score": done / PARTS, "tests_passed": done, "tests_total": PARTS}

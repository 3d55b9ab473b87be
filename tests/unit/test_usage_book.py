"""services/rollout/usage.py: per-job call totals, bounded by job count."""

from __future__ import annotations

import pytest

from services.rollout.usage import UsageBook


def test_calls_tokens_and_context_per_job() -> None:
    t = [100.0]
    book = UsageBook(clock=lambda: t[0])
    book.started("a")
    book.started("a")
    assert book.snapshot(["a"])[0].in_flight == 2
    t[0] = 101.0
    book.ended("a", prompt_tokens=1000, cached_tokens=900, output_tokens=50)
    book.ended("a", prompt_tokens=10, output_tokens=0, finished=False)  # an error: no tokens, no call
    book.started("b")
    book.ended("b", prompt_tokens=5, output_tokens=5)
    (a,) = book.snapshot(["a"])
    assert (a.calls, a.in_flight, a.prompt_tokens, a.cached_tokens, a.output_tokens) == (1, 0, 1000, 900, 50)
    assert a.max_context_tokens == a.last_context_tokens == 1050
    assert (a.first_call_at_s, a.last_call_at_s) == (100.0, 101.0)
    book.started("a")
    book.ended("a", prompt_tokens=200, output_tokens=10)
    (a,) = book.snapshot(["a"])
    assert (a.max_context_tokens, a.last_context_tokens, a.calls) == (1050, 210, 2)
    assert [u.job_id for u in book.snapshot(["b", "zz", "a", "b"])] == ["b", "a"]


def test_keeps_the_most_recently_active_jobs_only() -> None:
    book = UsageBook(max_jobs=3)
    for j in "abcd":
        book.started(j)
        book.ended(j, prompt_tokens=1)
    book.started("b")  # b is now the most recent
    book.started("e")
    assert [u.job_id for u in book.snapshot()] == ["d", "b", "e"]
    with pytest.raises(ValueError):
        UsageBook(max_jobs=0)

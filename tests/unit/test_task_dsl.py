"""GyreStack interpreter: semantics, limits on untrusted code, module calls."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.task.dsl import DslError, Limits, run_program


@pytest.mark.parametrize(
    ("code", "x", "want"),
    [
        ("x 3 + 2 *", 4, 14),
        ("x 2 -", 9, 7),
        ("x 2 swap -", 9, -7),  # 2 - x
        ("x 7 /", -8, -2),  # floor division
        ("x 3 %", -1, 2),
        ("x neg abs", 5, 5),
        ("x dup *", 6, 36),
        ("x 1 drop", 3, 3),
        ("x 4 max 9 min", 20, 9),
        ("-3 x +", 3, 0),
    ],
)
def test_semantics(code: str, x: int, want: int) -> None:
    assert run_program(code, x) == want


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        ("", "empty"),
        ("x +", "underflow"),
        ("x 1", "stack"),
        ("x 0 /", "div_zero"),
        ("x import os", "syntax"),
        ("__import__('os')", "syntax"),
        ("x 100 +", "syntax"),
        ("x m9", "undefined"),
    ],
)
def test_errors_have_reasons(code: str, reason: str) -> None:
    with pytest.raises(DslError) as err:
        run_program(code, 1)
    assert err.value.reason == reason


def test_limits_bound_untrusted_programs() -> None:
    with pytest.raises(DslError, match="overflow"):
        run_program("x " + "dup * " * 10, 10)
    with pytest.raises(DslError) as err:
        run_program("x " + "dup " * 40 + "drop " * 20, 1, limits=Limits(max_program_tokens=64, max_stack=32))
    assert err.value.reason == "stack"
    with pytest.raises(DslError) as err:
        run_program("x " * 65, 1)
    assert err.value.reason == "too_long"
    with pytest.raises(DslError) as err:
        run_program("x 1 +", 1, limits=Limits(max_steps=2))
    assert err.value.reason == "steps"


def test_module_calls_and_recursion() -> None:
    mods = {"m1": "x 1 +", "m2": "x m1 2 *", "m3": "x m3", "m4": "x m5", "m5": "x m4"}
    assert run_program(mods["m2"], 3, modules=mods, name="m2") == 8
    for name in ("m3", "m4"):
        with pytest.raises(DslError) as err:
            run_program(mods[name], 1, modules=mods, name=name)
        assert err.value.reason == "recursion"


def test_step_budget_is_shared_across_calls() -> None:
    # m1 runs 3 steps per call; m2 calls it 4 times: 4 * 3 + 8 > 16.
    mods = {"m1": "x 1 +", "m2": "x m1 m1 m1 m1"}
    assert run_program(mods["m2"], 0, modules=mods, name="m2", limits=Limits(max_steps=17)) == 4
    with pytest.raises(DslError, match="steps"):
        run_program(mods["m2"], 0, modules=mods, name="m2", limits=Limits(max_steps=16))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["x", "1", "9", "+", "-", "*", "/", "%", "swap", "dup", "drop", "neg", "max",
                                 "m1", "zz", "(", ""]), max_size=70), st.integers(-50, 50))
def test_fuzz_never_crashes_outside_dsl_error(tokens: list[str], x: int) -> None:
    try:
        out = run_program(" ".join(tokens), x, modules={"m1": "x dup *"})
    except DslError:
        return
    assert isinstance(out, int) and abs(out) <= 10**9

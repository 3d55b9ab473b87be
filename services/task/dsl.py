"""GyreStack: the tiny stack language the built-in XLong task's modules are written in.

A module is one function of one integer argument. Its code is a whitespace-separated postfix
program, e.g. ``x 3 + 2 *`` computes ``(x + 3) * 2``:

    x            push the argument
    0..99        push an integer literal (a leading ``-`` is allowed: ``-3``)
    + - * / %    pop b, pop a, push a op b (floor division / modulo; dividing by 0 is an error)
    max min      pop b, pop a, push max(a, b) / min(a, b)
    neg abs      replace the top with -top / abs(top)
    dup drop swap  the usual stack shuffles
    m<k>         call another module of the same workspace on the top (pop 1, push its result)

A program must leave exactly one value on the stack. Code is untrusted (a model wrote it), so the
interpreter is pure Python with hard limits on program size, steps (across calls), stack depth,
call depth and value magnitude; every violation raises `DslError` with a short reason that the
harness shows to the agent. Nothing is ever passed to ``eval``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DslError", "Limits", "MODULE_NAME_RE", "parse_program", "run_program", "BINARY_OPS", "UNARY_OPS"]

MODULE_NAME_RE = re.compile(r"^m[0-9]{1,3}$")
_INT_RE = re.compile(r"^-?[0-9]{1,2}$")

BINARY_OPS = frozenset({"+", "-", "*", "/", "%", "max", "min"})
UNARY_OPS = frozenset({"neg", "abs"})
STACK_OPS = frozenset({"dup", "drop", "swap"})


class DslError(Exception):
    """A program is malformed or failed at run time; `reason` is a short word for the agent."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Hard bounds on one evaluation (one test input), shared across nested module calls."""

    max_program_tokens: int = 64
    """Longest accepted program, in DSL tokens."""
    max_steps: int = 2_000
    """Instructions executed in one evaluation, counting those of called modules."""
    max_stack: int = 32
    """Deepest stack any program may build."""
    max_call_depth: int = 8
    """Nested module calls; deeper (or recursive) calls fail with `recursion`."""
    max_abs_value: int = 10**9
    """Largest magnitude a value may reach; beyond it the evaluation fails with `overflow`."""

    def __post_init__(self) -> None:
        for name in ("max_program_tokens", "max_steps", "max_stack", "max_call_depth", "max_abs_value"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be >= 1, got {getattr(self, name)}.")


def parse_program(code: str, *, limits: Limits = Limits()) -> tuple[str, ...]:
    """Split and check `code`; raise `DslError` on an unknown token or an over-long program."""
    tokens = tuple(code.split())
    if not tokens:
        raise DslError("empty")
    if len(tokens) > limits.max_program_tokens:
        raise DslError("too_long", f"{len(tokens)} tokens > {limits.max_program_tokens}")
    for tok in tokens:
        if tok == "x" or tok in BINARY_OPS or tok in UNARY_OPS or tok in STACK_OPS:
            continue
        if _INT_RE.match(tok) or MODULE_NAME_RE.match(tok):
            continue
        raise DslError("syntax", f"unknown token {tok[:16]!r}")
    return tokens


class _Run:
    """One evaluation: a step budget shared by the program and all modules it calls."""

    def __init__(self, modules: Mapping[str, str], limits: Limits) -> None:
        self.modules = modules
        self.limits = limits
        self.steps = 0
        self.parsed: dict[str, tuple[str, ...]] = {}

    def call(self, name: str, arg: int, depth: int, active: tuple[str, ...]) -> int:
        if name in active:
            raise DslError("recursion", f"{name} calls itself")
        if depth > self.limits.max_call_depth:
            raise DslError("recursion", "call depth")
        if name not in self.parsed:
            code = self.modules.get(name)
            if code is None:
                raise DslError("undefined", name)
            self.parsed[name] = parse_program(code, limits=self.limits)
        return self.execute(self.parsed[name], arg, depth, active + (name,))

    def execute(self, tokens: tuple[str, ...], arg: int, depth: int, active: tuple[str, ...]) -> int:
        lim = self.limits
        stack: list[int] = []
        for tok in tokens:
            self.steps += 1
            if self.steps > lim.max_steps:
                raise DslError("steps", f"more than {lim.max_steps} steps")
            if tok == "x":
                stack.append(arg)
            elif tok in BINARY_OPS:
                if len(stack) < 2:
                    raise DslError("underflow", tok)
                b = stack.pop()
                a = stack.pop()
                stack.append(_binary(tok, a, b))
            elif tok in UNARY_OPS:
                if not stack:
                    raise DslError("underflow", tok)
                stack[-1] = -stack[-1] if tok == "neg" else abs(stack[-1])
            elif tok == "dup":
                if not stack:
                    raise DslError("underflow", tok)
                stack.append(stack[-1])
            elif tok == "drop":
                if not stack:
                    raise DslError("underflow", tok)
                stack.pop()
            elif tok == "swap":
                if len(stack) < 2:
                    raise DslError("underflow", tok)
                stack[-1], stack[-2] = stack[-2], stack[-1]
            elif tok[0] == "m":
                if not stack:
                    raise DslError("underflow", tok)
                stack.append(self.call(tok, stack.pop(), depth + 1, active))
            else:
                stack.append(int(tok))
            if len(stack) > lim.max_stack:
                raise DslError("stack", f"deeper than {lim.max_stack}")
            if stack and abs(stack[-1]) > lim.max_abs_value:
                raise DslError("overflow")
        if len(stack) != 1:
            raise DslError("stack", f"{len(stack)} values left, want 1")
        return stack[0]


def _binary(op: str, a: int, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op in ("/", "%"):
        if b == 0:
            raise DslError("div_zero")
        return a // b if op == "/" else a % b
    return max(a, b) if op == "max" else min(a, b)


def run_program(
    code: str,
    arg: int,
    *,
    modules: Mapping[str, str] | None = None,
    name: str | None = None,
    limits: Limits = Limits(),
) -> int:
    """Evaluate `code` on `arg`; `modules` (name -> code) resolves calls to other modules.

    `name` is the module being evaluated, so a call to itself is reported as recursion.
    """
    run = _Run(modules or {}, limits)
    tokens = parse_program(code, limits=limits)
    return run.execute(tokens, arg, 0, (name,) if name else ())

"""Every piece of text the built-in harness shows the model, in one place.

A context is a flat token sequence built from these segments; role tags are special tokens of the
built-in tokenizer, so the same conversation rendered through its chat template tokenizes to the
same ids (the OpenAI-compatible path and the TITO path see one format). The agent writes a module
one line per step, then the harness runs the module's visible tests:

    <|system|> task modules m1 m2 m3 m4
    <|user|> module m1 tests 8 -> 4 8 , 1 -> - 8
    <|user|> step x <|assistant|> x <eos>
    <|user|> step sub 2 <|assistant|> 2 - <eos>
    <|user|> step mul 8 <|assistant|> 8 * <eos>
    <|tool|> m1 pass 2 / 2
    <|user|> module m2 tests ...  ...steps...
    <|tool|> m2 fail 1 / 2 : 4 -> 1 2 want 1 4 fix m2      (then the steps again)
    <|tool|> subagent m3 pass 2 / 2                          (m3 was delegated)
    <|user|> summarize <|assistant|> m1 pass m2 fail m3 pass <eos>      (role summary)

After a compaction the agent continues in a fresh context:
``<|system|> task modules ... <|user|> summary <the summary's own output ids> ...``.
The parsers at the bottom read these formats back (the demonstrator uses them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from services.task.spec import ModuleSpec, TaskSpec

ASSISTANT = "<|assistant|>"
EOS = "<eos>"
SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", EOS, "<|system|>", "<|user|>", ASSISTANT, "<|tool|>")
ERROR_REASONS = (
    "empty",
    "too_long",
    "syntax",
    "recursion",
    "undefined",
    "steps",
    "underflow",
    "div_zero",
    "stack",
    "overflow",
    "timeout",
    "missing",
)
# Words besides digits, module names and DSL operators that segments use.
WORDS = (
    "task", "modules", "module", "step", "tests", "fix", "pass", "fail", "error", "want",
    "subagent", "for", "summarize", "summary", "x", "add", "sub", "rsub", "mul", "(", ")", "->", ",", ":", "/",
)  # fmt: skip
MAX_MODULES = 64


def system_main(task: TaskSpec) -> str:
    names = " ".join(m.name for m in task.modules)
    return f"<|system|> task modules {names}"


def system_subagent(module: ModuleSpec) -> str:
    return f"<|system|> subagent for {module.name}"


def _tests(tests: Iterable[tuple[int, int]]) -> str:
    return " , ".join(f"{x} -> {y}" for x, y in tests)


def module_header(module: ModuleSpec) -> str:
    """Opens the work on a module: its name and visible tests."""
    return f"<|user|> module {module.name} tests {_tests(module.visible_tests)}"


def step_request(step: str) -> str:
    """Asks for the code line of one step; ends in the assistant tag, so a model call follows."""
    return f"<|user|> step {step} {ASSISTANT}"


def test_report(name: str, passed: int, total: int, failure: str) -> str:
    """Harness output after running a module's visible tests; `failure` is the first problem."""
    verdict = "pass" if passed == total else "fail"
    tail = f" : {failure}" if failure and passed < total else ""
    return f"<|tool|> {name} {verdict} {passed} / {total}{tail}"


def failure_text(x: int, got: int | None, want: int, error: str | None) -> str:
    if error is not None:
        return f"error {error}"
    return f"{x} -> {got} want {want}"


def fix_request(name: str) -> str:
    """Appended to a failing report: the module's steps follow again."""
    return f" fix {name}"


def subagent_report(name: str, passed: int, total: int) -> str:
    verdict = "pass" if passed == total else "fail"
    return f"<|tool|> subagent {name} {verdict} {passed} / {total}"


def summary_request() -> str:
    return f"<|user|> summarize {ASSISTANT}"


def summary_header() -> str:
    return "<|user|> summary"


# ---- parsing (the demonstrator reads prompts back) -------------------------------------------
_STEP_RE = re.compile(r"<\|user\|> step ([^<]+?) <\|assistant\|>\s*$")
_SUMMARIZE_RE = re.compile(r"summarize <\|assistant\|>\s*$")
_FIX_RE = re.compile(r" fix (m\d+)\b")
_MODULE_RE = re.compile(r"<\|user\|> module (m\d+)\b")
_STATUS_RE = re.compile(r"(m\d+) (pass|fail)\b")


def parse_request(prompt_text: str) -> tuple[str, str]:
    """What a prompt asks for: ("step", step text) or ("summarize", "")."""
    m = _STEP_RE.search(prompt_text)
    if m:
        return "step", m.group(1)
    if _SUMMARIZE_RE.search(prompt_text):
        return "summarize", ""
    raise ValueError(f"prompt asks for nothing the built-in task knows: ...{prompt_text[-60:]!r}")


def in_fix_turn(prompt_text: str) -> bool:
    """Whether the current module attempt follows a failing report (a fix turn)."""
    last_module = max((m.start() for m in _MODULE_RE.finditer(prompt_text)), default=-1)
    last_fix = max((m.start() for m in _FIX_RE.finditer(prompt_text)), default=-1)
    return last_fix > last_module


def summarize_statuses(prompt_text: str) -> str:
    """The ideal summary of a context: the latest pass/fail of every module it mentions."""
    latest: dict[str, str] = {}
    for name, verdict in _STATUS_RE.findall(prompt_text):
        latest.pop(name, None)  # re-insert, so modules appear in the order of their last result
        latest[name] = verdict
    return " ".join(f"{n} {v}" for n, v in latest.items())

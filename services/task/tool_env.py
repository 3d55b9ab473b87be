"""The built-in XLong task as tools: the actions an agent takes on a task's workspace.

Any tool-calling loop can solve a built-in task through these four functions (OpenAI function
specs in `TOOLS`); the built-in tool agent (services.task.tool_agent) is one such loop, a
third-party harness (openai-agents, smolagents, a CLI through a shell command) is another:

    open_module(module)          start (or restart) a module: its visible tests and first step
    write_line(module, code)     the GyreStack line of the module's current step
    run_tests(module)            run the module's visible tests on the workspace so far
    read_file(path)              read a workspace file (``src/<module>.gs``)

Every result ends in a hint of what to do next (``next write_line m1 step sub 2``, ``next
run_tests m1``, ``next open_module m2``, ``reply done``), the way a test runner or a linter points
at the next problem; the policy's work is to turn a step into the right code line, and to keep
going. A sample session::

    open_module {"module": "m1"}            -> module m1 tests 8 -> 48 , 1 -> -8 . next write_line m1 step x
    write_line {"module": "m1", "code": "x"} -> ok . next write_line m1 step sub 2
    write_line {"module": "m1", "code": "2 -"} -> ok . next run_tests m1
    run_tests {"module": "m1"}              -> m1 pass 2 / 2 . next open_module m2

A failing run points back at the module (``m1 fail 1 / 2 : 4 -> 12 want 14 . next open_module m1``)
while fix turns remain, then at the next module. A `Scope` limits a sub-agent to one module (its
last hint is ``reply done``). The workspace keeps each module's best attempt, as the word-level
agent does, with the attempts counted for the scorer (``harness/attempts.json``).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from services.task.agent import ExecutionResult, TestRun, run_visible_tests
from services.task.scoring import ATTEMPTS_PATH
from services.task.spec import ModuleSpec, TaskSpec

__all__ = ["TOOLS", "TOOL_NAMES", "INSTRUCTIONS", "Scope", "ToolResult", "ToolTask", "task_message",
           "subagent_message", "render_call", "parse_call", "DONE"]

DONE = "done"

TOOLS: tuple[dict[str, Any], ...] = (
    {"name": "open_module", "description": "Start or restart a module: shows its tests and its first step.",
     "parameters": {"type": "object", "properties": {"module": {"type": "string"}}, "required": ["module"]}},
    {"name": "write_line", "description": "Write the GyreStack code line of the module's current step.",
     "parameters": {"type": "object", "properties": {"module": {"type": "string"}, "code": {"type": "string"}},
                    "required": ["module", "code"]}},
    {"name": "run_tests", "description": "Run the module's visible tests.",
     "parameters": {"type": "object", "properties": {"module": {"type": "string"}}, "required": ["module"]}},
    {"name": "read_file", "description": "Read a workspace file, e.g. src/m1.gs.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
)
TOOL_NAMES = tuple(t["name"] for t in TOOLS)

INSTRUCTIONS = ("You write GyreStack modules, postfix programs of one integer x. Each step becomes one "
                "code line: x, a call m2 ( x ) as x m2, add c as c +, sub c as c -, mul c as c *, rsub c "
                "as c swap -.")


def task_message(task: TaskSpec) -> str:
    """The main agent's first user message."""
    names = " ".join(m.name for m in task.modules)
    return f"task modules {names} . next open_module {task.modules[0].name}"


def subagent_message(module: ModuleSpec) -> str:
    """A sub-agent's first user message."""
    return f"subagent for {module.name} . next open_module {module.name}"


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_JSON = json.JSONDecoder()
_SPACE = re.compile(r"\s*")


def render_call(name: str, arguments: dict[str, Any]) -> str:
    """A call as the model writes it: the Hermes format the gateway parses (``tool_parser=hermes``)."""
    return f'{_OPEN}\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n{_CLOSE}'


def parse_call(text: str) -> tuple[str, dict[str, Any]] | None:
    """The first call in a reply (name, arguments) if it is well formed, else None.

    The call is the JSON object after the first opening tag, followed by the closing tag. The object
    ends where its JSON ends, so a closing tag written inside one of its strings (a file's text) is
    text, not the call's end, as in the gateway's Hermes parser."""
    start = text.find(_OPEN)
    if start < 0:
        return None
    try:
        obj, end = _JSON.raw_decode(text, _SPACE.match(text, start + len(_OPEN)).end())  # type: ignore[union-attr]
    except json.JSONDecodeError:
        return None
    if not text.startswith(_CLOSE, _SPACE.match(text, end).end()):  # type: ignore[union-attr]
        return None  # an object not closed by the tag: cut by max_tokens, or text
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments"), dict):
        return None
    return obj["name"], obj["arguments"]


@dataclass(frozen=True)
class Scope:
    """What one agent works on: every module in order (main), or one module (a sub-agent)."""

    modules: tuple[str, ...]
    subagent: bool = False


@dataclass(frozen=True)
class ToolResult:
    """A tool's answer. `final_fail`: a module's tests failed with no fix turn left (the harness may
    branch back for a retry instead of showing it); `delegate`: the module goes to a sub-agent."""

    text: str
    module: str = ""
    run: TestRun | None = None
    final_fail: bool = False
    delegate: bool = False


@dataclass
class _Open:
    module: ModuleSpec
    lines: list[str] = field(default_factory=list)


class ToolTask:
    """One execution's workspace behind the tools. Lifecycle: ToolTask(task) -> call()* -> files."""

    def __init__(self, task: TaskSpec, *, fix_turns: int = 1, delegate_every: int = 0) -> None:
        self.task = task
        self.fix_turns = fix_turns
        self.delegated = {m.name for i, m in enumerate(task.modules) if delegate_every and (i + 1) % delegate_every == 0}
        self.handed: set[str] = set()  # delegated modules a sub-agent has had (once each)
        self.codes: dict[str, str] = {}
        self.best: dict[str, int] = {}
        self.files: dict[str, bytes] = {}
        self.attempts: Counter[str] = Counter()
        self.fails: Counter[str] = Counter()  # failing runs of the current branch, per module
        self.module_passed: dict[str, bool] = {}
        self.open: dict[str, _Open] = {}

    # ---- the tools -------------------------------------------------------------------------------
    def call(self, name: str, arguments: dict[str, Any], scope: Scope) -> ToolResult:
        """Run one tool call; bad calls get an ``error`` result that says what to do instead."""
        if name not in TOOL_NAMES:
            return ToolResult(f"error : no tool {name[:40]} . {self.hint(scope)}")
        want = ("path",) if name == "read_file" else ("module", "code") if name == "write_line" else ("module",)
        if set(arguments) != set(want) or not all(isinstance(arguments[k], str) for k in want):
            return ToolResult(f"error : {name} takes {' , '.join(want)} . {self.hint(scope)}")
        if name == "read_file":
            data = self.files.get(arguments["path"])
            return ToolResult(data.decode() if data is not None else f"error : no file {arguments['path'][:60]}")
        module = arguments["module"]
        if module not in scope.modules:
            return ToolResult(f"error : no module {module[:20]} here . {self.hint(scope)}")
        spec = self.task.module(module)
        if name == "open_module":
            return self._open(spec, scope)
        if name == "write_line":
            return self._write(spec, arguments["code"], scope)
        return self._test(spec, scope)

    def _open(self, module: ModuleSpec, scope: Scope) -> ToolResult:
        if module.name in self.delegated and not scope.subagent:
            if module.name in self.handed:
                return ToolResult(f"error : a subagent built {module.name} . {self.hint(scope)}")
            self.handed.add(module.name)
            return ToolResult("", module=module.name, delegate=True)
        self.open[module.name] = _Open(module)
        self.attempts[module.name] += 1
        self.files[ATTEMPTS_PATH] = json.dumps(dict(sorted(self.attempts.items()))).encode()
        tests = " , ".join(f"{x} -> {y}" for x, y in module.visible_tests)
        return ToolResult(f"module {module.name} tests {tests} . next write_line {module.name} step {module.steps[0]}",
                          module=module.name)

    def _write(self, module: ModuleSpec, code: str, scope: Scope) -> ToolResult:
        att = self.open.get(module.name)
        if att is None:
            return ToolResult(f"error : {module.name} is not open . next open_module {module.name}")
        if len(att.lines) == len(module.steps):
            return ToolResult(f"error : {module.name} has all its lines . next run_tests {module.name}")
        att.lines.append(" ".join(code.split())[:200])
        if len(att.lines) < len(module.steps):
            return ToolResult(f"ok . next write_line {module.name} step {module.steps[len(att.lines)]}",
                              module=module.name)
        return ToolResult(f"ok . next run_tests {module.name}", module=module.name)

    def _test(self, module: ModuleSpec, scope: Scope) -> ToolResult:
        att = self.open.get(module.name)
        if att is None or len(att.lines) < len(module.steps):
            return ToolResult(f"error : {module.name} is not written . {self.hint(scope)}")
        del self.open[module.name]
        code = " ".join(att.lines)
        run = run_visible_tests(module, {**self.codes, module.name: code})
        self.record(module, code, run)
        verdict = "pass" if run.passed == run.total else "fail"
        head = f"{module.name} {verdict} {run.passed} / {run.total}"
        if run.passed == run.total:
            return ToolResult(f"{head} . {self.after(module.name, scope)}", module=module.name, run=run)
        self.fails[module.name] += 1
        head += f" : {run.failure}"
        if self.fails[module.name] <= self.fix_turns:
            return ToolResult(f"{head} . next open_module {module.name}", module=module.name, run=run)
        return ToolResult(f"{head} . {self.after(module.name, scope)}", module=module.name, run=run, final_fail=True)

    # ---- state -------------------------------------------------------------------------------
    def record(self, module: ModuleSpec, code: str, run: TestRun) -> None:
        """Keep the best attempt of each module in the workspace (later wins ties)."""
        if run.passed >= self.best.get(module.name, -1):
            self.best[module.name] = run.passed
            self.codes[module.name] = code
            self.files[TaskSpec.module_path(module.name)] = code.encode()
        self.module_passed[module.name] = self.best[module.name] == run.total

    def restart_branch(self, module: str) -> None:
        """A retry: the module's failing runs of the abandoned branch no longer count."""
        self.fails[module] = 0
        self.open.pop(module, None)

    def after(self, module: str, scope: Scope) -> str:
        """The hint once ``module`` is done (passed, or failed for good)."""
        i = scope.modules.index(module)
        if i + 1 < len(scope.modules):
            return f"next open_module {scope.modules[i + 1]}"
        return f"reply {DONE}"

    def hint(self, scope: Scope) -> str:
        """Where the agent stands: the open module's next action, else the first module not done."""
        for name in scope.modules:
            att = self.open.get(name)
            if att is not None:
                if len(att.lines) < len(att.module.steps):
                    return f"next write_line {name} step {att.module.steps[len(att.lines)]}"
                return f"next run_tests {name}"
        for name in scope.modules:
            if name not in self.module_passed and not (name in self.handed and not scope.subagent):
                return f"next open_module {name}"
        return f"reply {DONE}"

    def export(self, result: ExecutionResult) -> None:
        """Copy the workspace, the modules' verdicts and the attempts into an execution's result."""
        result.files = dict(self.files)
        result.module_passed = dict(self.module_passed)
        result.attempts = self.attempts.copy()

    def subagent_report(self, module: str) -> str:
        """The main agent's result of a delegated ``open_module``."""
        passed, total = self.best.get(module, 0), len(self.task.module(module).visible_tests)
        verdict = "pass" if passed == total else "fail"
        return f"subagent {module} {verdict} {passed} / {total}"


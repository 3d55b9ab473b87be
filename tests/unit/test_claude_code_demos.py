"""Claude Code's conversation for the tool model's warm start (services.task.claude_code_dialect,
services.task.tool_demos.run_claude_code_demo): the bodies the pinned CLI sends in the claude-code
loop, through the gateway's Messages -> chat conversion and endpoint code in process."""

from __future__ import annotations

import random

import numpy as np

from services.rollout.anthropic_http import to_chat
from services.task.agent import CallContext, Generation, Sampling
from services.task.claude_code_dialect import (CLAUDE_CODE_BASH_TOOL, CLAUDE_CODE_IDENTITY, claude_code_request,
                                               permission_refusal)
from services.task.demos import DemoNoise, training_sequences
from services.task.spec import TaskParams, generate_task
from services.task.tool_demos import ToolDemonstrator, run_claude_code_demo
from services.task.tool_env import DONE, parse_call
from services.task.tool_shell import SHELL_INSTRUCTIONS
from services.task.tool_tokenizer import IM_START, ToolCodec, train_tokenizer

BOOT = ToolCodec(train_tokenizer([], vocab_size=300))


def _run(seed: int, demo: object | None = None) -> tuple[ToolDemonstrator, object]:
    task = generate_task(11, TaskParams(num_modules=3))
    # without its habit (sub c written as c swap -) the demonstrator solves every module
    demo = demo or ToolDemonstrator(BOOT, DemoNoise(minus_swap_pct=None, fix_minus_swap_pct=None), "claude-code")
    env = run_claude_code_demo(task, demo, codec=BOOT, fix_turns=1, max_turns=200,  # type: ignore[arg-type]
                               rng=random.Random(seed))
    return demo, env  # type: ignore[return-value]


def test_claude_code_demonstrations_solve_the_task_through_its_conversation() -> None:
    demo, env = _run(0)
    assert all(env.module_passed.values()) and len(env.module_passed) == 3  # type: ignore[attr-defined]
    texts = [BOOT.tok.decode([int(i) for i in c.prompt_ids], skip_special_tokens=False) for c in demo.calls]
    replies = [BOOT.decode(c.output_ids) for c in demo.calls]
    calls = [parse_call(r) for r in replies]
    # gyre-task commands in its Bash tool; the last reply has no call (that ends the CLI's run)
    assert calls[0] == ("Bash", {"command": "gyre-task open_module m1"})
    assert all(c is not None and c[0] == "Bash" and c[1]["command"].startswith("gyre-task ") for c in calls[:-1])
    assert calls[-1] is None and replies[-1].strip() == DONE
    # its system: the billing line, the Agent SDK's identity, the instructions; its one tool
    assert texts[0].startswith(f"{IM_START}system\nx-anthropic-billing-header: cc_version=2.1.328.")
    assert CLAUDE_CODE_IDENTITY + SHELL_INSTRUCTIONS in texts[0] and '"name": "Bash"' in texts[0]
    # one linear conversation: every call's prompt extends the last (one training sequence)
    assert len(training_sequences(demo.calls)) == 1
    # a function of the seed
    again, _ = _run(0)
    assert [c.prompt_ids.tolist() for c in again.calls] == [c.prompt_ids.tolist() for c in demo.calls]


class _Echo:
    """A ModelClient that answers every call with a fixed text."""

    def __init__(self, text: str, times: int) -> None:
        self.text, self.times, self.prompts = text, times, []  # type: ignore[var-annotated]

    def generate(self, context: CallContext, prompt_ids: np.ndarray, sampling: Sampling, *,
                 timeout_s: float) -> Generation:
        self.prompts.append(BOOT.tok.decode([int(i) for i in prompt_ids], skip_special_tokens=False))
        text = self.text if len(self.prompts) <= self.times else DONE
        out = np.concatenate([BOOT.encode(text), [BOOT.eos_id]]).astype(np.int32)
        return Generation(output_ids=out, logprobs=np.zeros(len(out), np.float32), weight_version=1,
                          finish_reason="stop")


def test_a_command_other_than_gyre_task_gets_the_cli_permission_refusal() -> None:
    echo = _Echo('<tool_call>\n{"name": "Bash", "arguments": {"command": "rm -rf /"}}\n</tool_call>', times=1)
    _, env = _run(1, echo)
    assert len(echo.prompts) == 2 and permission_refusal("Bash") in echo.prompts[1]
    assert not any(env.module_passed.values())  # type: ignore[attr-defined]


def test_the_request_is_the_cli_shape_the_gateway_reads() -> None:
    body = claude_code_request([{"role": "user", "content": "task modules m1 . next gyre-task open_module m1"}],
                               fingerprint="abc", model="builtin-tools")
    assert body["system"][0]["text"] == "x-anthropic-billing-header: cc_version=2.1.328.abc; cc_entrypoint=sdk-cli;"
    assert body["tools"] == [CLAUDE_CODE_BASH_TOOL] and CLAUDE_CODE_BASH_TOOL["input_schema"]["required"] == ["command"]
    chat = to_chat(body)
    assert [m["role"] for m in chat["messages"]] == ["system", "user"]
    assert chat["tools"][0]["function"]["name"] == "Bash" and chat["max_tokens"] == 256

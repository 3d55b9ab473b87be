"""arith-v1: deterministic disjoint splits, exact partial scoring, and a harness whose contexts keep
the model's own ids (SmolLM2's real BPE tokenizer and chat template; a scripted policy stands in
for the model so every reply is known)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from services.models.source import SMOLLM2, resolve_model
from services.task import arith
from services.task.agent import CallContext, Generation, Sampling
from services.task.chat_context import ChatContext


@pytest.fixture(scope="module")
def tok() -> Any:
    return AutoTokenizer.from_pretrained(str(resolve_model(SMOLLM2)), local_files_only=True)


def chain_value(questions: tuple[str, ...]) -> list[int]:
    """Independent reading of the questions: the running value after each turn."""
    a, op, b = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", questions[0]).groups()  # type: ignore[union-attr]
    value = int(a) + int(b) if op == "+" else int(a) - int(b)
    out = [value]
    for q in questions[1:]:
        n = int(re.findall(r"\d+", q)[0])
        value = value + n if q.startswith("Add") else value - n if q.startswith("Subtract") else value * n
        out.append(value)
    return out


def test_tasks_are_pure_functions_of_their_ids() -> None:
    params = arith.ArithParams(turns=4, max_operand=12)
    ids = arith.task_ids(50, split="train", params=params, start_seed=7)
    assert ids[0] == "arith-v1/train/7/n4.v12"
    for task_id in ids:
        task = arith.task_from_id(task_id)
        assert task == arith.task_from_id(task_id) and task.task_id == task_id
        assert len(task.questions) == 4 and list(task.answers) == chain_value(task.questions)
        assert all(0 <= v <= 999 for v in task.answers)
    assert len({arith.task_from_id(t).questions for t in ids}) > 40
    for bad in ("xlong-v1/train/0/m4", "arith-v1/test/0/n3.v10", "arith-v1/train/0/n0.v10", "arith-v1/train/x/n3.v10"):
        with pytest.raises(ValueError):
            arith.task_from_id(bad)
    with pytest.raises(ValueError, match="turns"):
        arith.ArithParams(turns=0)
    with pytest.raises(ValueError, match="split"):
        arith.generate_task(0, split="dev")


def test_heldout_problems_are_never_train_problems() -> None:
    params = arith.ArithParams(turns=1, max_operand=10)  # a small problem space: seeds collide often
    train = {arith.generate_task(s, params, split="train").questions for s in range(400)}
    heldout = {arith.generate_task(s, params, split="heldout").questions for s in range(400)}
    assert len(heldout) > 20 and len(train) > 80
    assert not train & heldout


def test_scoring_is_exact_and_partial() -> None:
    task = arith.ArithTask(task_id="t", questions=("What is 7 + 5?", "Multiply that by 3.", "Add 1 to that."),
                           answers=(12, 36, 37))
    assert arith.parse_answer("7 + 5 = 12.") == 12
    assert arith.parse_answer("11 - 14 = -3") == -3
    assert arith.parse_answer("1,234") == 1234
    assert arith.parse_answer("twelve") is None
    s = arith.score_answers(task, ["7 + 5 = 12", "12 * 3 = 35", "36 + 1 = 37"])
    assert s.correct == (True, False, True) and s.reward == pytest.approx(2 / 3) and not s.all_passed
    assert arith.score_answers(task, ["12"]).correct == (True, False, False)  # timed out after turn 1
    assert arith.score_answers(task, ["12", "36", "37"]).all_passed


def test_score_entry_point_grades_a_workspace_from_the_task_id() -> None:
    task_id = arith.task_ids(1, split="heldout")[0]
    task = arith.task_from_id(task_id)
    right = [f"= {v}" for v in task.answers]
    out = arith.score({arith.ANSWERS_PATH: json.dumps(right).encode()}, task_id, "finished")
    assert out["score"] == 1.0 and out["tests_passed"] == out["tests_total"] == len(task.answers)
    half = arith.score({arith.ANSWERS_PATH: json.dumps(right[:1]).encode()}, task_id, "timeout")
    assert half["tests_passed"] == 1 and half["score"] == pytest.approx(1 / len(task.answers))
    for files in ({}, {arith.ANSWERS_PATH: b"\xff"}, {arith.ANSWERS_PATH: b'{"a": 1}'}):
        assert arith.score(files, task_id, "failed")["score"] == 0.0
    with pytest.raises(ValueError):
        arith.score({}, "arith-v1/nope", "finished")


def test_task_generator_for_the_scheduler() -> None:
    payloads = arith.task_generator({"turns": "2", "start_seed": "10"}, 3, 4)
    ids = [json.loads(p)["task_id"] for p in payloads]
    assert ids == arith.task_ids(4, params=arith.ArithParams(turns=2), start_seed=22)
    assert payloads == arith.task_generator({"turns": "2", "start_seed": "10"}, 3, 4)
    with pytest.raises(ValueError, match="unknown params"):
        arith.task_generator({"modules": "3"}, 0, 1)
    with pytest.raises(ValueError, match="invalid"):
        arith.task_generator({"turns": "many"}, 0, 1)


# ---------------------------------------------------------------------------------- harness
class Scripted:
    """A ModelClient whose reply to turn k is ``reply(k, task)`` as ids (ending with <|im_end|> unless cut)."""

    def __init__(self, tok: Any, reply: Callable[[int, list[int]], np.ndarray],
                 clock: list[float] | None = None) -> None:
        self.tok, self.reply, self.clock = tok, reply, clock
        self.calls: list[tuple[CallContext, np.ndarray, np.ndarray, Sampling]] = []

    def generate(self, context: CallContext, prompt_ids: np.ndarray, sampling: Sampling, *,
                 timeout_s: float) -> Generation:
        out = self.reply(len(self.calls), list(prompt_ids))
        self.calls.append((context, np.asarray(prompt_ids).copy(), out, sampling))
        if self.clock is not None:
            self.clock[0] += 10.0  # each call takes 10 s of the harness's clock
        return Generation(output_ids=out, logprobs=np.zeros(len(out), np.float32), weight_version=3,
                          finish_reason="stop")


def encode(tok: Any, text: str, *, eos: bool = True) -> np.ndarray:
    ids = tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])
    return np.asarray(ids, dtype=np.int32)


def test_harness_contexts_extend_exactly_and_render_the_chat_template(tok: Any) -> None:
    task = arith.task_from_id("arith-v1/train/3/n3.v10")
    client = Scripted(tok, lambda k, _p: encode(tok, f"x = {task.answers[k]}"))
    res = arith.run_arith_execution(task, client, tok, execution_id="ex-1", job_id="j")
    assert res.status == "finished" and res.reward == 1.0 and res.all_passed
    assert res.replies == [f"x = {v}" for v in task.answers]
    assert json.loads(res.files[arith.ANSWERS_PATH]) == res.replies
    # Turn 1's prompt is the template rendered once and tokenized once (SmolLM2's ChatML format).
    opening = [{"role": "system", "content": arith.SYSTEM_PROMPT}]
    for q, a in arith.DEMO:
        opening += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    first = tok.apply_chat_template([*opening, {"role": "user", "content": task.questions[0]}], tokenize=False,
                                    add_generation_prompt=True)
    assert first.endswith("<|im_start|>assistant\n")
    assert client.calls[0][1].tolist() == tok(first, add_special_tokens=False)["input_ids"]
    # Every later prompt is the previous prompt + the model's own ids + the new turn: one linear path.
    for (_, p0, o0, _), (ctx, p1, _, sampling) in zip(client.calls, client.calls[1:]):
        assert p1[: len(p0) + len(o0)].tolist() == p0.tolist() + o0.tolist() and len(p1) > len(p0) + len(o0)
        assert sampling.stop_token_ids == (tok.eos_token_id,) and ctx.execution_id == "ex-1"
    assert [c[0].call_id for c in client.calls] == ["main/1", "main/2", "main/3"]
    assert len({c[3].seed for c in client.calls}) == 3
    # And the whole context decodes to the template's rendering of the whole conversation.
    ids = np.concatenate([client.calls[-1][1], client.calls[-1][2]])
    convo = [*opening]
    for q, r in zip(task.questions, res.replies):
        convo += [{"role": "user", "content": q}, {"role": "assistant", "content": r}]
    assert tok.decode(ids.tolist()) == tok.apply_chat_template(convo, tokenize=False).rstrip("\n")


def test_harness_keeps_ids_whose_retokenization_would_differ(tok: Any) -> None:
    task = arith.task_from_id("arith-v1/train/5/n2.v10")
    # "12" spelled as ids of "1" and "2" is BPE-canonical; " answer" split into characters is not.
    odd = np.asarray([i for ch in " answer" for i in tok(ch, add_special_tokens=False)["input_ids"]], np.int32)
    assert tok(" answer", add_special_tokens=False)["input_ids"] != odd.tolist()
    client = Scripted(tok, lambda k, _p: np.concatenate([odd, encode(tok, f" {task.answers[k]}")]))
    res = arith.run_arith_execution(task, client, tok, execution_id="ex-2")
    p0, o0, p1 = client.calls[0][1], client.calls[0][2], client.calls[1][1]
    assert p1[: len(p0) + len(o0)].tolist() == p0.tolist() + o0.tolist()
    assert res.replies[0] == f" answer {task.answers[0]}" and res.all_passed


def test_cut_off_reply_is_closed_by_the_template(tok: Any) -> None:
    task = arith.task_from_id("arith-v1/train/8/n2.v10")
    client = Scripted(tok, lambda k, _p: encode(tok, f"{task.answers[k]} is", eos=False))
    res = arith.run_arith_execution(task, client, tok, execution_id="ex-3", config=arith.ArithConfig(max_new_tokens=4))
    p0, o0, p1 = client.calls[0][1], client.calls[0][2], client.calls[1][1]
    assert p1[: len(p0) + len(o0)].tolist() == p0.tolist() + o0.tolist()
    # The turn was not ended by the model, so the template's end-of-turn id follows its ids.
    assert p1[len(p0) + len(o0)] == tok.eos_token_id
    assert client.calls[0][3].max_new_tokens == 4 and res.replies == [f"{v} is" for v in task.answers]


def test_timeout_keeps_the_replies_so_far_for_partial_scoring(tok: Any) -> None:
    task = arith.task_from_id("arith-v1/train/1/n3.v10")
    clock = [0.0]
    client = Scripted(tok, lambda k, _p: encode(tok, str(task.answers[k])), clock=clock)
    res = arith.run_arith_execution(task, client, tok, execution_id="ex-4", deadline_s=15.0, clock=lambda: clock[0])
    assert res.status == "timeout" and len(client.calls) == 2 and res.replies == [str(task.answers[0])]
    assert res.reward == pytest.approx(1 / 3)
    assert arith.score(res.files, task.task_id, res.status)["tests_passed"] == 1


def test_evaluate_is_greedy_and_counts_whole_tasks(tok: Any) -> None:
    params = arith.ArithParams(turns=2)

    class FirstTurnOnly:
        """Right on turn 1 of every task, wrong after (reads the question back from the prompt)."""

        def generate(self, context: CallContext, prompt_ids: np.ndarray, sampling: Sampling, *,
                     timeout_s: float) -> Generation:
            assert sampling.temperature == 0
            text = tok.decode(prompt_ids.tolist())
            m = re.findall(r"What is (\d+) ([+-]) (\d+)\?", text)[-1]
            turn1 = int(m[0]) + int(m[2]) if m[1] == "+" else int(m[0]) - int(m[2])
            answer = turn1 if context.call_id == "main/1" else -1
            out = encode(tok, f"= {answer}")
            return Generation(output_ids=out, logprobs=np.zeros(len(out), np.float32), weight_version=0,
                              finish_reason="stop")

    ev = arith.evaluate(FirstTurnOnly(), tok, n=6, params=params, concurrency=3)
    assert [r.task_id for r in ev.results] == arith.task_ids(6, split="heldout", params=params)
    assert ev.accuracy == 0.0 and ev.mean_reward == 0.5 and ev.turn_accuracy == [1.0, 0.0]
    with pytest.raises(ValueError, match="greedy"):
        arith.evaluate(FirstTurnOnly(), tok, n=1, config=arith.ArithConfig(temperature=1.0))


def test_chat_context_needs_a_chat_template(tok: Any) -> None:
    class NoTemplate:
        chat_template = None
        eos_token_id = 2

    with pytest.raises(ValueError, match="chat template"):
        ChatContext(NoTemplate())
    ctx = ChatContext(tok)
    ids = ctx.ask("hi")
    assert ctx.answer(encode(tok, "hello")) == "hello"
    assert ctx.ask("again")[: len(ids)].tolist() == ids.tolist()


def test_progress_is_preserved_after_each_turn_and_cancel_ends_as_timeout(tok: Any) -> None:
    import threading

    task = arith.task_from_id("arith-v1/train/2/n3.v10")
    snapshots: list[list[str]] = []
    cancelled = threading.Event()

    def reply(k: int, _p: list[int]) -> np.ndarray:
        if k == 1:
            cancelled.set()  # the job is cancelled while turn 2 is generated
        return encode(tok, str(task.answers[k]))

    res = arith.run_arith_execution(task, Scripted(tok, reply), tok, execution_id="ex-5", cancelled=cancelled,
                                    on_progress=lambda files: snapshots.append(json.loads(files[arith.ANSWERS_PATH])))
    # the workspace after turn 1 and after turn 2 reached the harness; then the cancel ended it
    assert snapshots == [[str(task.answers[0])], [str(task.answers[0]), str(task.answers[1])]]
    assert res.status == "timeout" and res.reward == pytest.approx(2 / 3)


def test_builtin_reward_scorer_and_scheduler_generator_know_arith() -> None:
    from services.reward.scorers import ScoreInput, ScorerSpec, run_local
    from services.scheduler.tasks import TASK_GENERATORS

    task = arith.task_from_id("arith-v1/train/4/n3.v10")
    files = {arith.ANSWERS_PATH: json.dumps([f"= {task.answers[0]}", "no idea"]).encode()}
    out = run_local(ScorerSpec(kind="builtin", target="arith-v1"),
                    ScoreInput(job_id="j", execution_id="e", task_id=task.task_id, status="timeout", files=files))
    assert out.score == pytest.approx(1 / 3) and out.tests_passed == 1 and out.tests_total == 3
    assert TASK_GENERATORS["arith-v1"]({"turns": "3"}, 1, 2) == arith.task_generator({"turns": "3"}, 1, 2)

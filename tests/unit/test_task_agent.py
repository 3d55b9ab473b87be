"""The built-in agent loop: compaction, sub-agents, retries from an earlier context, fix turns,
the execution timeout with a preserved workspace, and TITO-exact contexts with a real tiny model."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from services.task import prompts
from services.task.agent import AgentConfig, CallContext, Generation, Sampling, run_execution
from services.task.demos import (
    MAX_MODULE_NAMES,
    DemoNoise,
    Demonstrator,
    collect_demonstrations,
    module_name_ids,
    relabel_modules,
    training_sequences,
)
from services.task.gateway_client import common_prefix_len
from services.task.scoring import MODULE_KINDS, first_attempt_by_kind, module_kind, score_workspace
from services.task.spec import TaskParams, TaskSpec, generate_task
from services.task.tokenizer import Codec

torch.set_num_threads(1)
CODEC = Codec()
PARAMS = TaskParams(num_modules=4, min_ops=2, max_ops=3)


def _task_with_weak_steps() -> tuple[TaskSpec, list[str]]:
    """A task (no calls between modules) where some modules have a `sub c` step: a demonstrator
    that always swaps fails exactly those."""
    params = TaskParams(num_modules=4, min_ops=2, max_ops=3, call_pct=0)
    for seed in range(500):
        task = generate_task(seed, params)
        weak = [m.name for m in task.modules if any(s.startswith("sub ") for s in m.steps)]
        if weak and len(weak) < len(task.modules):
            return task, weak
    raise AssertionError("no suitable task")


def _decode(ids: np.ndarray) -> str:
    return str(CODEC.tok.decode([int(i) for i in ids], skip_special_tokens=False))


def test_compaction_subagents_retries_and_fixes_appear_in_the_calls() -> None:
    task, weak = _task_with_weak_steps()
    demo = Demonstrator(task, CODEC, DemoNoise(minus_swap_pct=100, fix_minus_swap_pct=100))
    cfg = AgentConfig(context_limit_tokens=96, delegate_every=2, fix_turns=1, retries=1, temperature=1.0)
    result = run_execution(task, demo, codec=CODEC, config=cfg, execution_id="e1")
    assert result.status == "finished"
    assert {n for n, ok in result.module_passed.items() if not ok} == set(weak)
    assert result.events["compactions"] >= 1 and result.events["subagents"] == 2
    assert result.events["retries"] == len(weak) and result.events["fix_turns"] >= len(weak)
    roles = [c.role for c in demo.calls]
    assert {"main", "subagent", "summary"} <= set(roles)
    # Sub-agents work in their own contexts.
    sub = [c for c in demo.calls if c.role == "subagent"]
    assert all(_decode(c.prompt_ids).startswith("<|system|> subagent for m") for c in sub)
    # Compaction: the next call of the compacted agent starts a fresh context whose first tokens
    # are its system segment, the summary header and the summary call's own output ids.
    s_idx = roles.index("summary")
    summary = demo.calls[s_idx]
    assert _decode(summary.prompt_ids).rstrip().endswith("summarize <|assistant|>")
    # The context it summarizes is that of the last earlier call whose whole sequence it extends.
    compacted = next(
        c for c in reversed(demo.calls[:s_idx])
        if common_prefix_len(np.concatenate([c.prompt_ids, c.output_ids]), summary.prompt_ids)
        == len(c.prompt_ids) + len(c.output_ids)
    )
    later = next(c for c in demo.calls[s_idx + 1 :] if c.role == compacted.role)
    system = CODEC.encode(_decode(compacted.prompt_ids).split(" <|user|>")[0])
    head = np.concatenate([system, CODEC.encode(prompts.summary_header()), summary.output_ids[:-1]])
    np.testing.assert_array_equal(later.prompt_ids[: len(head)], head)
    assert len(later.prompt_ids) < len(summary.prompt_ids)
    # Retry: a branch from the earlier context repeats a prompt exactly (same prefix, new call).
    keys = [c.prompt_ids.tobytes() for c in demo.calls]
    assert len(keys) - len(set(keys)) >= len(weak)
    # The workspace keeps each module's best attempt; the scorer agrees with the harness.
    score = score_workspace(task, result.files)
    assert [m.ok for m in score.modules] == [result.module_passed[m.name] for m in task.modules]


def test_a_faithful_demonstrator_solves_everything_and_sequences_fold_prefixes() -> None:
    task = generate_task(7, PARAMS)
    demo = Demonstrator(task, CODEC, DemoNoise(minus_swap_pct=None, fix_minus_swap_pct=None))
    result = run_execution(task, demo, codec=CODEC, config=AgentConfig(context_limit_tokens=96), execution_id="e2")
    assert result.status == "finished" and all(result.module_passed.values())
    assert score_workspace(task, result.files).all_passed
    assert result.events["fix_turns"] == result.events["retries"] == 0
    seqs = training_sequences(demo.calls)
    # Every generated token is trained exactly once: calls that are prefixes of later ones fold in.
    assert sum(int(m.sum()) for _, m in seqs) == sum(len(c.output_ids) for c in demo.calls)
    assert len(seqs) < len(demo.calls)
    for seq, mask in seqs:
        assert len(seq) == len(mask) and mask.any() and not mask[0]


class _CountingClock:
    """A clock that advances one unit per model call (the deadline is in calls, not seconds)."""

    def __init__(self, inner: Demonstrator) -> None:
        self.inner, self.now = inner, 0.0

    def __call__(self) -> float:
        return self.now

    def generate(self, context: CallContext, prompt_ids: np.ndarray, sampling: Sampling, *,
                 timeout_s: float) -> Generation:
        self.now += 1.0
        return self.inner.generate(context, prompt_ids, sampling, timeout_s=timeout_s)


def test_timeout_ends_the_execution_and_keeps_its_workspace() -> None:
    task = generate_task(3, TaskParams(num_modules=6))
    clocked = _CountingClock(Demonstrator(task, CODEC, DemoNoise(minus_swap_pct=0, fix_minus_swap_pct=0)))
    snapshots: list[dict[str, bytes]] = []
    result = run_execution(task, clocked, codec=CODEC, config=AgentConfig(delegate_every=0, fix_turns=0, retries=0),
                           execution_id="e3", deadline_s=9.5, clock=clocked, on_progress=snapshots.append)
    assert result.status == "timeout" and clocked.now == 10.0
    code = {k: v for k, v in result.files.items() if k.startswith("src/")}
    assert snapshots and {k: v for k, v in snapshots[-1].items() if k.startswith("src/")}.items() <= code.items()
    score = score_workspace(task, result.files)
    assert 0 < score.passed < score.total  # partial credit from the preserved workspace
    assert score.modules[-1].error == "missing"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.task.model import BuiltinModelSpec, ensure_builtin_model

    spec = BuiltinModelSpec(demo_tasks=40, snippet_steps=20, sft_steps=20, batch_size=16)
    cache = tmp_path_factory.mktemp("models")
    path = ensure_builtin_model(cache, spec=spec)
    assert ensure_builtin_model(cache, spec=spec) == path  # built once, then reused
    return path


def test_real_tiny_model_in_process_contexts_are_token_exact(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.task.local_client import LocalModelClient

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat = [{"role": "system", "content": "task modules m1"}, {"role": "user", "content": "step sub 2"},
            {"role": "assistant", "content": "2 -"}, {"role": "tool", "content": "m1 pass 2 / 2"}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    harness_ids = CODEC.encode("<|system|> task modules m1 <|user|> step sub 2 <|assistant|> 2 - <eos> "
                               "<|tool|> m1 pass 2 / 2 <|assistant|>")
    assert tok(text, add_special_tokens=False)["input_ids"] == harness_ids.tolist()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    client = LocalModelClient(model)
    task = generate_task(11, PARAMS)
    cfg = AgentConfig(context_limit_tokens=96, delegate_every=2, temperature=1.0)
    result = run_execution(task, client, codec=Codec.from_dir(tiny_model_dir), config=cfg, execution_id="e4")
    assert result.status == "finished" and result.calls["main"] > 0 and result.calls["subagent"] > 0
    recs = client.records
    assert all(len(r.output_ids) == len(r.logprobs) and (r.logprobs <= 0).all() for r in recs)
    # Within one agent, between compactions and retries, each prompt extends the previous call's
    # prompt + output exactly (no re-tokenization).
    extended = 0
    for prev, cur in zip(recs, recs[1:]):
        if prev.context.agent_id == cur.context.agent_id and prev.context.role == cur.context.role:
            full = np.concatenate([prev.prompt_ids, prev.output_ids])
            if common_prefix_len(full, cur.prompt_ids) == len(full):
                extended += 1
    assert extended >= len(recs) // 2


def test_common_prefix_len() -> None:
    a = np.array([1, 2, 3, 4], dtype=np.int32)
    assert common_prefix_len(a, a) == 4
    assert common_prefix_len(a, a[:2]) == 2
    assert common_prefix_len(a, np.array([1, 9], dtype=np.int32)) == 1
    assert common_prefix_len(a, np.array([], dtype=np.int32)) == 0


def test_evaluate_grades_held_out_tasks_through_a_model_client() -> None:
    from services.task.evaluate import evaluate
    from services.task.spec import task_ids

    ids = task_ids(6, split="heldout")

    class Faithful:
        """Answers every call like the demonstrator without its habit (all code right)."""

        def generate(self, context: CallContext, prompt_ids: np.ndarray, sampling: Sampling, *,
                     timeout_s: float) -> Generation:
            tid = context.execution_id.split("/", 2)[2]
            return Demonstrator(generate_task_from(tid), CODEC, DemoNoise(minus_swap_pct=None,
                                fix_minus_swap_pct=None)).generate(context, prompt_ids, sampling, timeout_s=timeout_s)

    report = evaluate(Faithful(), ids, codec=CODEC, concurrency=3, tag="v0")
    assert report.pass_rate == 1.0 and report.mean_reward == 1.0 and report.timeouts == 0
    habit = evaluate(_Habit(), ids, codec=CODEC, concurrency=1)
    assert habit.pass_rate < 1.0 and len(habit.passed) == 6


def generate_task_from(task_id: str) -> TaskSpec:
    from services.task.spec import task_from_id

    return task_from_id(task_id)


class _Habit:
    """Always writes `sub c` as `c swap -` (the warm start's habit at 100%)."""

    def generate(self, context: CallContext, prompt_ids: np.ndarray, sampling: Sampling, *,
                 timeout_s: float) -> Generation:
        task = generate_task_from(context.execution_id.split("/", 2)[2])
        demo = Demonstrator(task, CODEC, DemoNoise(minus_swap_pct=100, fix_minus_swap_pct=100))
        return demo.generate(context, prompt_ids, sampling, timeout_s=timeout_s)


def test_relabelled_demonstrations_rename_every_module_alike_and_keep_the_rest() -> None:
    # A task whose modules call earlier ones: its call steps are where a name must be copied.
    params = TaskParams(num_modules=6, min_ops=1, max_ops=2, call_pct=80)
    task = next(t for t in (generate_task(s, params) for s in range(200)) if sum(bool(m.calls) for m in t.modules) >= 3)
    demo = Demonstrator(task, CODEC, DemoNoise(minus_swap_pct=None, fix_minus_swap_pct=None))
    run_execution(task, demo, codec=CODEC, config=AgentConfig(context_limit_tokens=96), execution_id="e-rl")
    names = module_name_ids(CODEC)
    assert len(names) == MAX_MODULE_NAMES and CODEC.encode("m17")[0] == names[16]
    renamed = relabel_modules(demo.calls, names, random.Random(3), len(task.modules))
    assert len(renamed) == len(demo.calls)
    seen: dict[int, int] = {}
    for old, new in zip(demo.calls, renamed, strict=True):
        assert old.role == new.role and len(old.prompt_ids) == len(new.prompt_ids)
        for a, b in ((old.prompt_ids, new.prompt_ids), (old.output_ids, new.output_ids)):
            is_name = np.isin(a, names)
            np.testing.assert_array_equal(a[~is_name], b[~is_name])  # everything else untouched
            for x, y in zip(a[is_name].tolist(), b[is_name].tolist(), strict=True):
                assert seen.setdefault(x, y) == y  # one name, one new name, everywhere
    # m1..m6 became six distinct names in the same order, and the module names are all renamed.
    olds = sorted(seen)
    assert olds == names[: len(task.modules)].tolist()
    assert [seen[o] for o in olds] == sorted(set(seen.values())) and seen != {o: o for o in olds}
    # A call step's answer still names the module its request names.
    for c in renamed:
        kind, step = prompts.parse_request(_decode(c.prompt_ids))
        if kind == "step" and "(" in step:
            assert _decode(c.output_ids).split()[1] == step.split()[0]
    with pytest.raises(ValueError, match="relabel_pct"):
        collect_demonstrations(num_tasks=1, params=params, agent=AgentConfig(), noise=DemoNoise(), codec=CODEC,
                               relabel_pct=101)


def test_first_attempt_by_kind_finds_the_kind_that_fails() -> None:
    task, weak = _task_with_weak_steps()
    demo = Demonstrator(task, CODEC, DemoNoise(minus_swap_pct=100, fix_minus_swap_pct=100))
    result = run_execution(task, demo, codec=CODEC, config=AgentConfig(context_limit_tokens=96, retries=0),
                           execution_id="e-kinds")
    kinds = first_attempt_by_kind(task, score_workspace(task, result.files))
    assert set(kinds) == set(MODULE_KINDS) and kinds["call"] == (0, 0)
    assert kinds["sub"] == (len(weak), 0)  # every module with a sub step failed its first attempt
    others = len(task.modules) - len(weak)
    assert kinds["rsub"][0] + kinds["plain"][0] == others
    assert kinds["rsub"][1] + kinds["plain"][1] == others
    assert [module_kind(m) == "sub" for m in task.modules] == [m.name in weak for m in task.modules]

"""The CUDA paths: tree attention backends, chunked long paths, the engine's prefix reuse and its
decode CUDA graphs, on a GPU.

Skipped where torch sees no CUDA device (CI); run on a GPU host with
``pytest tests/unit/test_cuda_paths.py``. Everything here runs in fp32 with TF32 off, so the
backends are compared with the same tolerances as the CPU tests.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from services.trainer.model import build_model
from services.algorithm import ObjectiveConfig, policy_loss
from services.trainer.synthetic import make_step
from services.trainer.tree_forward import TreePolicy, TreeTensors
from tests.unit.test_trainer_tree_forward import _chain as cpu_chain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _exact_fp32() -> Iterator[None]:
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _on(t: TreeTensors, device: str) -> TreeTensors:
    return dataclasses.replace(t, **{f.name: getattr(t, f.name).to(device) for f in dataclasses.fields(t)
                                     if isinstance(getattr(t, f.name), torch.Tensor)})


def _forest(tokens: int, vocab: int) -> TreeTensors:
    """Executions of ~120 tokens (a trunk, two levels of two branches) packed into one batch."""
    step = make_step(7, num_executions=max(1, tokens // 120), depth=2, branching=2, micro_batch_tokens=1 << 30,
                     vocab=vocab)
    return _on(TreeTensors.from_batch(step.batches[0]), "cuda")


def _chain(n: int) -> TreeTensors:
    """One path of ``n`` tokens (the CPU tests' ``_chain``: the tiny model's 512 words), on CUDA."""
    return _on(cpu_chain(n), "cuda")


def _loss_and_grads(net: torch.nn.Module, policy: TreePolicy, t: TreeTensors) -> tuple[torch.Tensor, dict]:
    net.zero_grad(set_to_none=True)
    lp, ent = policy.target_logprobs(t)
    ((lp * t.loss_weights).sum() + 0.01 * ent.mean()).backward()
    return lp.detach(), {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}


def _assert_same(got: tuple[torch.Tensor, dict], want: tuple[torch.Tensor, dict], what: str) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4, msg=lambda m: f"{what} log-probs: {m}")
    assert got[1].keys() == want[1].keys() and want[1]
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-3, atol=1e-5,
                                   msg=lambda m, name=name: f"{what} gradient of {name}: {m}")


@pytest.mark.parametrize("kind,tokens", [("forest", 2048), ("forest", 8192), ("path", 4096)])
def test_compiled_flex_and_block_sparse_equal_the_dense_mask_in_loss_and_gradients(kind: str, tokens: int) -> None:
    """The compiled flex BlockMask kernel (CUDA's backend above max_dense_tokens) and the block-sparse
    backend give the dense SDPA mask's log-probs and every parameter gradient, forward and backward."""
    net = build_model("tiny", seed=1, device="cuda")
    vocab = net.config.vocab_size
    t = _forest(tokens, vocab) if kind == "forest" else _chain(tokens)
    dense = _loss_and_grads(net, TreePolicy(net, attention="sdpa", max_dense_tokens=1 << 20), t)
    flex = _loss_and_grads(net, TreePolicy(net, attention="flex"), t)
    blocks = _loss_and_grads(net, TreePolicy(net, attention="blocks", sparse_block_tokens=256), t)
    _assert_same(flex, dense, "flex")
    _assert_same(blocks, dense, "blocks")


def test_auto_uses_flex_and_one_compile_serves_every_batch_length() -> None:
    """CUDA's auto backend is the compiled flex kernel for all but the smallest batches, compiled
    with dynamic shapes: micro-batches of many lengths (as a real step's are) all train, each equal
    to the dense mask (a static compile would recompile per length and give up after 8)."""
    net = build_model("tiny", seed=2, device="cuda")
    policy = TreePolicy(net, attention="auto")
    assert policy.backend_for(3000) == "flex" and policy.backend_for(100) == "sdpa"
    dense = TreePolicy(net, attention="sdpa", max_dense_tokens=1 << 20)
    for n in range(1000, 12_000, 1000):  # 11 lengths
        t = _forest(n, net.config.vocab_size)
        _assert_same(_loss_and_grads(net, policy, t), _loss_and_grads(net, dense, t), f"flex at {t.num_tokens}")


@pytest.mark.parametrize("kind,chunk", [("path", 1024), ("forest", 512)])
def test_chunked_training_on_cuda_equals_the_whole_batch(kind: str, chunk: int) -> None:
    net = build_model("tiny", seed=3, device="cuda")
    vocab = net.config.vocab_size
    t = _chain(4096) if kind == "path" else _forest(2048, vocab)
    cfg = ObjectiveConfig(entropy_coef=0.01)

    def loss_of(lp: torch.Tensor, ent: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        return policy_loss(lp, t.old_logprobs[sel], t.advantages[sel], t.loss_weights[sel], config=cfg,
                           entropy=ent).loss

    whole = TreePolicy(net, attention="blocks", sparse_block_tokens=128)
    lp, ent = whole.target_logprobs(t)
    loss_of(lp, ent, torch.arange(t.num_targets, device="cuda")).backward()
    ref = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad(set_to_none=True)
    got = TreePolicy(net, attention="blocks", sparse_block_tokens=128, chunk_tokens=chunk).train_chunked(t, loss_of)
    assert got is not None
    torch.testing.assert_close(got[0], lp.detach(), rtol=1e-4, atol=1e-4)
    grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    assert grads.keys() == ref.keys() and ref
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-3, atol=1e-5, msg=name)


def test_the_engine_on_cuda_reuses_an_agents_context_exactly() -> None:
    """Greedy calls of a growing context on the CUDA engine: with prefix reuse, the same tokens as
    without, and each later call prefills only its new tail."""
    from services.rollout.torch_engine import TorchEngine, build_tiny_model
    from tests.unit.test_rollout_prefix_cache import _run

    cached = TorchEngine(build_tiny_model(512, seed=1), device="cuda", prefill_chunk_tokens=512)
    plain = TorchEngine(build_tiny_model(512, seed=1), device="cuda", prefill_chunk_tokens=512, prefix_cache_bytes=0)
    cached.start(), plain.start()
    try:
        rng = np.random.default_rng(0)
        context = rng.integers(0, 512, 1500).astype(np.int32)
        for turn in range(3):
            out_c, lp_c = _run(cached, f"c{turn}", context, 16)
            out_p, lp_p = _run(plain, f"p{turn}", context, 16)
            assert out_c == out_p, f"turn {turn}: reuse changed the greedy tokens"
            np.testing.assert_allclose(lp_c, lp_p, atol=1e-3)
            context = np.concatenate([context, np.asarray(out_c, np.int32), rng.integers(0, 512, 200).astype(np.int32)])
        stats = cached.prefix_stats()
        assert stats["reused_tokens"] > 0.8 * (stats["prompt_tokens"] - 1500)
    finally:
        cached.stop(), plain.stop()



def _decode(engine: object, specs: list[tuple[str, np.ndarray, int]],
            joining: list[tuple[str, np.ndarray, int]] = ()) -> dict[str, tuple[list[int], list[float]]]:  # type: ignore[assignment]
    """Greedy requests submitted together, then ``joining`` once the first has 5 tokens (rows join
    and leave mid-decode); each one's (tokens, logprobs)."""
    from services.rollout.engine import GenRequest, SamplingParams
    from tests.unit.test_rollout_engine import Collector

    col = Collector()

    def submit(batch: list[tuple[str, np.ndarray, int]]) -> None:
        for rid, prompt, n in batch:
            engine.submit(GenRequest(rid, prompt, SamplingParams(temperature=0.0, max_new_tokens=n)), col)  # type: ignore[attr-defined]

    submit(specs)
    if joining:
        while len(col.tokens(specs[0][0])) < 5:
            threading.Event().wait(0.001)
        submit(joining)
    for rid, _, _ in [*specs, *joining]:
        col.wait(rid)
    return {rid: (col.tokens(rid), col.logprobs(rid)) for rid, _, _ in [*specs, *joining]}


def _assert_same_decode(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for rid, (toks, lps) in want.items():
        assert got[rid][0] == toks, f"{rid}: the graph decode changed the tokens"
        np.testing.assert_allclose(got[rid][1], lps, atol=1e-4, err_msg=rid)


def _graph_and_eager_engines() -> tuple:
    from services.rollout.torch_engine import TorchEngine, build_tiny_model

    graphs = TorchEngine(build_tiny_model(512, seed=4), device="cuda", prefix_cache_bytes=0)  # graphs: CUDA's default
    eager = TorchEngine(build_tiny_model(512, seed=4), device="cuda", prefix_cache_bytes=0, cuda_graphs=False)
    assert graphs._static is not None and graphs._static.graphs and eager._static is None
    return graphs, eager


def _prompts(seed: int) -> Callable[[int], np.ndarray]:
    rng = np.random.default_rng(seed)
    return lambda n: rng.integers(0, 512, n).astype(np.int32)


def test_the_engines_decode_graphs_equal_the_eager_decode() -> None:
    """Batch 1, three lengths padded to a bucket of 4, and rows joining and leaving mid-decode
    (buckets 1 to 8): the replayed graphs give the eager decode's greedy tokens and log-probs."""
    graphs, eager = _graph_and_eager_engines()
    prompt = _prompts(0)
    one = [("one", prompt(9), 40)]
    three = [("a", prompt(3), 30), ("b", prompt(40), 25), ("c", prompt(17), 35)]
    early, churn = [("early", prompt(12), 70)], [(f"j{i}", prompt(4 + 9 * i), 6 + 7 * i) for i in range(6)]
    graphs.start(), eager.start()
    try:
        for specs, joining in ((one, []), (three, []), (early, churn)):
            _assert_same_decode(_decode(graphs, specs, joining), _decode(eager, specs, joining))
        assert graphs._static.captures >= 4  # buckets 1, 4 and 8 at least (2 as rows leave)
    finally:
        graphs.stop(), eager.stop()


def test_decode_graphs_are_recaptured_after_a_capacity_change_and_a_weight_swap() -> None:
    """A capacity change (the slot buffers reallocated) recaptures; graphs survive requests and
    in-place weight updates (a replay reads the new values), and are dropped when a parameter's
    storage changes. Each stage's tokens equal the eager engine's under the same weights."""
    graphs, eager = _graph_and_eager_engines()
    static = graphs._static
    prompt = _prompts(1)
    grow = [("long", prompt(200), 120), ("short", prompt(10), 90)]  # past the 256-token buffer
    small = [("x", prompt(8), 20)]
    graphs.start(), eager.start()
    try:
        gen = graphs._slots.generation
        _assert_same_decode(_decode(graphs, grow), _decode(eager, grow))
        assert graphs._slots.generation > gen and static.captures >= 3  # bucket 2 at 256 and 512 tokens, 1 at 512
        assert static.graph_count <= 2  # the old capacity's graphs were dropped
        _assert_same_decode(_decode(graphs, small), _decode(eager, small))
        captured = static.captures
        _assert_same_decode(_decode(graphs, small), _decode(eager, small))
        assert static.captures == captured  # same bucket and capacity: replayed, not recaptured

        update = {n: p.detach() * 1.1 for n, p in graphs.model.named_parameters()}
        for e in (graphs, eager):
            e.update_weights(update, version=1)
            assert e.wait_weight_version(1, timeout_s=30)
        _assert_same_decode(_decode(graphs, small), _decode(eager, small))
        assert static.captures == captured  # copied in place: the graphs read the new weights

        for e in (graphs, eager):  # new storage for one parameter, then weights installed into it
            norm = e.model.model.norm
            norm.weight = torch.nn.Parameter(norm.weight.detach().clone(), requires_grad=False)
            e.update_weights({"model.norm.weight": norm.weight.detach() * 1.5}, version=2)
            assert e.wait_weight_version(2, timeout_s=30)
        _assert_same_decode(_decode(graphs, small), _decode(eager, small))
        assert static.captures == captured + 1  # dropped, then captured again on the new storage
    finally:
        graphs.stop(), eager.stop()


def _tokenizer_dir() -> str:
    """SmolLM2's tokenizer files: ``GYRE_TEST_TOKENIZER_DIR`` on a GPU host without the model cache."""
    import os

    from services.models.source import SMOLLM2, resolve_model

    return os.environ.get("GYRE_TEST_TOKENIZER_DIR") or str(resolve_model(SMOLLM2))


def test_grammar_constrained_decode_on_cuda_with_graphs() -> None:
    """Schema-constrained requests batched with free ones on CUDA, decode replayed from graphs (the
    masked logits are a copy of the graph's output buffer): schema-valid JSON, forced flags, the
    same tokens and flags as the eager decode, and the unmasked logprobs of the reference forward."""
    import json

    from services.rollout.engine import GenRequest, SamplingParams
    from services.rollout.grammar import GrammarSpec
    from services.rollout.torch_engine import TorchEngine, build_tiny_model
    from tests.unit.test_rollout_engine import Collector

    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    spec = GrammarSpec("json_schema", json.dumps(schema))
    model = build_tiny_model(49152, hidden_size=64, seed=4).cuda()
    prompts = [np.random.default_rng(i).integers(100, 5000, 10 + i).astype(np.int32) for i in range(4)]
    runs = {}
    for graphs in (False, True):
        engine = TorchEngine(model, device="cuda", cuda_graphs=graphs, tokenizer_dir=_tokenizer_dir())
        engine.start()
        try:
            col = Collector()
            for i, p in enumerate(prompts):
                params = SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_new_tokens=80, stop_token_ids=(2,))
                engine.submit(GenRequest(f"c{i}", p, dataclasses.replace(params, grammar=spec)), col)
                engine.submit(GenRequest(f"f{i}", p, params), col)
            runs[graphs] = {}
            for i in range(4):
                evs = col.wait(f"c{i}")
                assert evs[-1].finish_reason == "stop"
                forced = [bool(x) for e in evs if e.forced is not None for x in e.forced]
                policy = [float(x) for e in evs if e.policy_logprobs is not None for x in e.policy_logprobs]
                runs[graphs][i] = (col.tokens(f"c{i}"), forced, policy)
                col.wait(f"f{i}")
            if graphs:
                assert engine.decode_graph_captures >= 1
        finally:
            engine.stop()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_tokenizer_dir(), local_files_only=True)
    for i in range(4):
        out, forced, policy = runs[True][i]
        value = json.loads(tok.decode(out[:-1]))
        assert set(value) == {"name", "n"} and 0 <= value["n"] <= 99 and forced[-1]
        if i % 2:  # greedy: graphs and eager agree token for token
            assert runs[True][i][:2] == runs[False][i][:2]
        ids = torch.from_numpy(np.concatenate([prompts[i], out]).astype(np.int64))[None].cuda()
        with torch.no_grad():
            ref = torch.log_softmax(model(input_ids=ids).logits[0, len(prompts[i]) - 1:-1].float(), -1)
        want = ref.gather(-1, torch.tensor(out, device="cuda")[:, None])[:, 0].cpu().numpy()
        np.testing.assert_allclose(policy, want, atol=1e-3)

"""Trainer benchmark: tree-packed vs per-path training, DP scaling, weight publishing, join latency.

Run: ``.venv/bin/python -m bench.bench_trainer`` (about 3 minutes on 2 CPU cores); writes
``bench/results/trainer.md``. Every comparison's baseline is measured in the same run:

1. Tree vs per-path training. Branching executions (a trunk with retries / sub-agent branches)
   are trained once tree-packed (position ids = depth, tree mask, each shared token once) and once
   with every root-to-leaf path expanded (each path a chain in the same packed format, the same
   token budget, the same kernels: only the shared prefixes are duplicated). Both compute the same
   gradient. Reported: tokens trained, time per step, and time ratio vs token ratio (target: time
   ratio >= 0.8 x token ratio).
2. Data-parallel scaling: the same step (fixed micro-batches) with the core alone and with the
   core + one replica process (gloo), one torch thread each. On a 2-core machine shared with
   other jobs this is an honest, noisy number.
3. Weight publishing: the core pushes a version to a rollout engine (Engine.UpdateWeights,
   chunked WeightChunk stream) and a replica pulls one (GetWeights); seconds per MB.
4. Replica join latency: AddReplica (process start, imports, JoinStep) and the weight pull.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from protos.gyre.v1 import rollout_pb2_grpc, trainer_pb2_grpc
from services.common.server import build_server
from services.rollout.host import EngineHost
from services.rollout.servicer import EngineServicer
from services.rollout.torch_engine import TorchEngine
from services.trainer.client import TrainerClient
from services.trainer.core import CoreTrainer
from services.trainer.build import build_learner
from services.trainer.job import TrainerJob
from services.trainer.main import TRAINER_SERVICE
from services.trainer.model import build_model
from services.trainer.servicer import TrainerServicer
from services.trainer.spawn import ReplicaProcesses
from services.trainer.synthetic import make_step, pack_paths
from services.trainer.weights import push_to_engines, state_bytes

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "trainer.md"
BENCH_MODEL = "tiny:layers=2,hidden=512,heads=8,kv_heads=4,intermediate=1536,vocab=4096"
BUDGET = 1024
EXECUTIONS = 2
PUBLISH_MODEL = "tiny:layers=8,hidden=512,heads=8,kv_heads=4,intermediate=1536,vocab=16384"


def _pass(learner: Any, batches: list[Any]) -> tuple[float, float]:
    """(wall s, this process's CPU s) of one forward+backward pass over ``batches``."""
    learner.begin_step(batches[0].step, 0)
    wall, cpu = time.perf_counter(), time.process_time()
    for b in batches:
        learner.train(b)
    return time.perf_counter() - wall, time.process_time() - cpu


SHAPES: list[tuple[str, dict[str, int]]] = [
    ("trunk + 2 retries x 2 levels", dict(depth=2, branching=2, context_tokens=48, generated_tokens=48, root_tokens=256)),
    ("trunk + 3 sub-agents x 2 levels", dict(depth=2, branching=3, context_tokens=32, generated_tokens=32,
                                              root_tokens=128)),
    ("long prompt, 4 samples", dict(depth=1, branching=4, context_tokens=0, generated_tokens=96, root_tokens=512))]
# the same shapes 4x longer, in 4x the budget: where the block-sparse attention (CPU's default above
# two 256-token blocks) skips what no query sees
LONG_BUDGET = 4 * BUDGET
LONG_SHAPES = [(name, {k: 4 * v if k != "depth" and k != "branching" else v for k, v in shape.items()})
               for name, shape in SHAPES]


def bench_tree_vs_paths(repeats: int = 2, *, attention: str = "sdpa", budget: int = BUDGET,
                        shapes: list[tuple[str, dict[str, int]]] = SHAPES) -> list[dict[str, Any]]:
    rows = []
    job = TrainerJob(job_id="bench", model=BENCH_MODEL, source="synthetic", attention=attention)
    learner = build_learner(job, "cpu")
    for name, shape in shapes:
        step = make_step(1, num_executions=EXECUTIONS, vocab=4096, micro_batch_tokens=budget, **shape)  # type: ignore[arg-type]
        path_batches = pack_paths(step.paths, micro_batch_tokens=budget)
        n_tree, n_path = step.tree_tokens, step.path_tokens
        _pass(learner, step.batches)  # warm-up
        tree, path = [], []
        for _ in range(repeats):  # alternate, so load from other jobs hits both alike
            tree.append(_pass(learner, step.batches))
            path.append(_pass(learner, path_batches))
        t_tree = statistics.median(c for _w, c in tree)
        t_path = statistics.median(c for _w, c in path)
        w_tree = statistics.median(w for w, _c in tree)
        w_path = statistics.median(w for w, _c in path)
        token_ratio = n_path / n_tree
        time_ratio = t_path / t_tree
        rows.append({"shape": name, "tree_tokens": n_tree, "path_tokens": n_path, "token_ratio": token_ratio,
                     "tree_s": t_tree, "path_s": t_path, "time_ratio": time_ratio, "wall_ratio": w_path / w_tree,
                     "tree_tok_s": n_tree / t_tree, "path_tok_s": n_path / t_path,
                     "target_met": time_ratio >= 0.8 * token_ratio})
    return rows


def _serve_core() -> tuple[CoreTrainer, Any, TrainerServicer, str]:
    core = CoreTrainer()
    servicer = TrainerServicer(core)
    server = build_server("trainer", [(trainer_pb2_grpc.add_TrainerServicer_to_server, servicer)],
                          service_names=[TRAINER_SERVICE]).start()
    return core, server, servicer, f"127.0.0.1:{server.port}"


def bench_dp_and_join(tmp: Path) -> dict[str, Any]:
    """Steps 0-1: core alone; then AddReplica; steps 2-3: core + replica. Times of steps 1 and 3."""
    source = "synthetic:seed=2,executions=8,tokens=700,depth=2,branching=2,context=32,generated=32,root=64,vocab=4096"
    job = TrainerJob(job_id="dp", model=BENCH_MODEL, source=source, num_steps=6, attention="sdpa")
    core, server, servicer, address = _serve_core()
    replicas = ReplicaProcesses(address, log_dir=str(tmp), extra_args=("--replica-threads", "1", "--log-level",
                                                                      "WARNING"))
    servicer.replicas = replicas
    client = TrainerClient(address)
    store = dist.TCPStore("127.0.0.1", core.store_port, is_master=False)
    prefix = "gyre/dp/synthetic"
    store.set(f"{prefix}/hold/3", "0")  # the core waits at step 3 until the replica is in
    try:
        client.start_job(job)
        solo = [client.wait_step(s, timeout_s=300).metrics["step_time_s"] for s in (0, 1, 2)]
        t0 = time.perf_counter()
        added = client.add_replica("cell-r", switch_id="bench", wait_s=300)
        join_s = time.perf_counter() - t0
        while int(store.add(f"{prefix}/waiting/3", 0)) < 2:
            time.sleep(0.01)
        store.set(f"{prefix}/release/3", "1")
        duo_reports = [client.wait_step(s, timeout_s=300) for s in (3, 4, 5)]
        assert all(r.metrics["world_size"] == 2 for r in duo_reports[1:]), "replica did not stay"
        duo = [r.metrics["step_time_s"] for r in duo_reports[1:]]
        pull_t0 = time.perf_counter()
        _, state = client.get_weights(-1)
        pull_s = time.perf_counter() - pull_t0
        tokens = duo_reports[-1].metrics["tokens"]
        return {"solo_step_s": statistics.median(solo[1:]), "duo_step_s": statistics.median(duo), "tokens": tokens,
                "join_s": join_s, "joined_step": added.step, "pull_s": pull_s, "pull_mb": state_bytes(state) / 1e6,
                "allreduce_s": duo_reports[-1].metrics["allreduce_s"]}
    finally:
        replicas.stop_all()
        client.close()
        core.stop()
        server.stop(0)


def bench_publish() -> dict[str, Any]:
    engine = TorchEngine(build_model(PUBLISH_MODEL, seed=3), model_name="bench")
    host = EngineHost(engine, cell_id="cell-p", kv_kinds=("tcp",))
    server = build_server("engine", [(rollout_pb2_grpc.add_EngineServicer_to_server, EngineServicer(host))],
                          service_names=["gyre.v1.Engine"]).start()
    host.address = f"127.0.0.1:{server.port}"
    host.start()
    model = build_model(PUBLISH_MODEL, seed=4)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mb = state_bytes(state) / 1e6
    times = []
    try:
        for version in range(1, 4):
            secs, ok, failed = push_to_engines(state, version, [host.address])
            assert ok == 1 and not failed
            engine.wait_weight_version(version, 60)
            times.append(secs)
        # GetWeights (what a joining replica pulls), same tensors, through a core's servicer.
        core, tserver, _servicer, address = _serve_core()
        core.weights.publish(model, 0)
        with TrainerClient(address) as client:
            pulls = []
            for _ in range(3):
                t0 = time.perf_counter()
                client.get_weights(0)
                pulls.append(time.perf_counter() - t0)
        tserver.stop(0)
        return {"mb": mb, "push_s": statistics.median(times), "pull_s": statistics.median(pulls)}
    finally:
        host.stop()
        server.stop(0)


def main() -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t_start = time.perf_counter()
    tree_rows = bench_tree_vs_paths()
    long_rows = {attention: bench_tree_vs_paths(attention=attention, budget=LONG_BUDGET, shapes=LONG_SHAPES)
                 for attention in ("sdpa", "blocks")}
    with tempfile.TemporaryDirectory() as tmp:
        dp = bench_dp_and_join(Path(tmp))
    pub = bench_publish()
    elapsed = time.perf_counter() - t_start

    lines = ["# Trainer benchmark", "",
             f"`python -m bench.bench_trainer`, CPU ({os.cpu_count()} cores, shared with other jobs), torch "
             f"{torch.__version__}, 1 torch thread per process, fp32, SDPA dense tree mask; model "
             f"`{BENCH_MODEL}` ({sum(p.numel() for p in build_model(BENCH_MODEL).parameters()) / 1e6:.1f}M params), "
             f"micro-batch budget {BUDGET} tokens. Total bench time {elapsed:.0f} s.", "",
             "## 1. Tree-packed vs per-path training (same gradient; baseline = every path expanded)", "",
             f"| executions ({EXECUTIONS} per step) | tree tokens | path tokens | token ratio | tree CPU s/step "
             "| path CPU s/step | time ratio (CPU) | time ratio (wall) | tree tok/s | path tok/s "
             "| time ratio >= 0.8 x token ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in tree_rows:
        lines.append(f"| {r['shape']} | {r['tree_tokens']} | {r['path_tokens']} | {r['token_ratio']:.2f}x | "
                     f"{r['tree_s']:.2f} | {r['path_s']:.2f} | {r['time_ratio']:.2f}x | {r['wall_ratio']:.2f}x | "
                     f"{r['tree_tok_s']:.0f} | {r['path_tok_s']:.0f} | {'yes' if r['target_met'] else 'NO'} |")
    lines += ["", f"### 1b. The same shapes 4x longer, micro-batch budget {LONG_BUDGET:,}: dense mask vs block-sparse", "",
              "| executions | attention | tree tokens | path tokens | token ratio | tree CPU s/step | path CPU s/step "
              "| time ratio (CPU) | tree tok/s | path tok/s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for attention, rows in long_rows.items():
        for r in rows:
            lines.append(f"| {r['shape']} | {attention} | {r['tree_tokens']} | {r['path_tokens']} | "
                         f"{r['token_ratio']:.2f}x | {r['tree_s']:.2f} | {r['path_s']:.2f} | {r['time_ratio']:.2f}x | "
                         f"{r['tree_tok_s']:.0f} | {r['path_tok_s']:.0f} |")
    dense_tree = sum(r["tree_s"] for r in long_rows["sdpa"])
    sparse_tree = sum(r["tree_s"] for r in long_rows["blocks"])
    lines += ["", f"Tree-packed steps with the block-sparse attention take {sparse_tree / dense_tree:.2f}x the dense "
              "mask's CPU time here (same tokens, same gradient). The dense mask's attention costs N^2 per "
              "micro-batch whatever the tree. The block-sparse one computes only the blocks where a query meets "
              "its ancestors, so its cost follows the sum of depths, as per-path causal attention's does."]
    speedup = dp["solo_step_s"] / dp["duo_step_s"]
    lines += ["", "Time = CPU seconds of the (single-threaded) training process, median of alternating tree/path "
              "passes after a warm-up: wall time on this shared 2-core machine swings with other jobs' load (the "
              "wall ratio is shown for reference). Tokens/s counts *trained* tokens; the tree trains fewer tokens "
              "for the same targets, so the useful comparison is time per step (time ratio = path / tree).", "",
              "The time ratio tracks the token ratio because per-token work (projections, MLP, LM head) dominates at "
              "this budget; attention with the dense SDPA mask costs N^2 per micro-batch whatever the tree shape, "
              "so it follows micro-batch fill rather than tokens. At 32K-128K tokens the dense mask is not an "
              "option (N^2 memory): the block-sparse backend (CPU's default, 1b) and, on CUDA, the compiled flex "
              "kernel compute only the blocks that hold ancestor pairs.",
              "",
              "## 2. Data-parallel scaling (core alone vs core + 1 replica process, gloo all-reduce)", "",
              "| replicas | step time s (median) | tokens/step | tokens/s | speed-up |", "|---:|---:|---:|---:|---:|",
              f"| 1 | {dp['solo_step_s']:.2f} | {dp['tokens']:.0f} | {dp['tokens'] / dp['solo_step_s']:.0f} | 1.00x |",
              f"| 2 | {dp['duo_step_s']:.2f} | {dp['tokens']:.0f} | {dp['tokens'] / dp['duo_step_s']:.0f} | "
              f"{speedup:.2f}x |", "",
              f"All-reduce of the gradients ({dp['pull_mb']:.0f} MB fp32) took {dp['allreduce_s']:.2f} s of the "
              f"2-replica step. The machine has 2 cores shared with other running jobs (and the replica's gRPC / "
              f"store traffic), so the ideal 2.00x is out of reach here; work is pulled on demand, so the "
              f"replicas finish within about one micro-batch of each other.", "",
              "## 3. Weight publishing (WeightChunk streams, 4 MiB chunks, localhost)", "",
              "| path | MB | seconds | s per MB | MB/s |", "|---|---:|---:|---:|---:|",
              f"| core -> engine `UpdateWeights` (push, staged + installed) | {pub['mb']:.0f} | {pub['push_s']:.2f} | "
              f"{pub['push_s'] / pub['mb'] * 1000:.1f} ms | {pub['mb'] / pub['push_s']:.0f} |",
              f"| core -> replica `GetWeights` (pull + assemble) | {pub['mb']:.0f} | {pub['pull_s']:.2f} | "
              f"{pub['pull_s'] / pub['mb'] * 1000:.1f} ms | {pub['mb'] / pub['pull_s']:.0f} |", "",
              "## 4. Replica join latency", "",
              "| phase | seconds |", "|---|---:|",
              f"| AddReplica: process start + imports + model build + JoinStep (joined step {dp['joined_step']}) | "
              f"{dp['join_s']:.2f} |",
              f"| GetWeights of the bench model ({dp['pull_mb']:.0f} MB) | {dp['pull_s']:.2f} |", "",
              "GPU figures (Qwen3-0.6B-sized config, bf16, the compiled flex kernel, 8K-64K tokens): "
              "bench/results/cuda.md (`python -m bench.bench_cuda` on a GPU host)."]
    text = "\n".join(lines) + "\n"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()

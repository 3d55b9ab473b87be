"""An engine process killed mid-request: the gateway re-prefills the call on a surviving engine
(prompt + tokens already streamed + seed) and the caller still gets the full, identical answer."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import torch

from services.common.metrics import REGISTRY
from services.rollout.calls import CallMeta, MigrationReport
from services.rollout.client import EngineClient, collect
from services.rollout.engine import SamplingParams
from tests.support.rollout_cluster import save_tiny_checkpoint, spawn_engine, start_gateway

torch.set_num_threads(1)


def reprefills() -> float:
    return REGISTRY.get_sample_value("gyre_rollout_gateway_fallbacks_total", {"kind": "reprefill"}) or 0.0


def test_killed_engine_is_replaced_by_reprefill_on_a_survivor(tmp_path: Path) -> None:
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt")
    procs = [spawn_engine(c, ckpt, tmp_path) for c in ("cell-a", "cell-b")]
    gw = start_gateway()
    try:
        for p in procs:
            p.wait_ready()
        client = gw.client()
        for p in procs:
            client.register_engine(p.cell_id, p.address)
        prompt = np.random.default_rng(5).integers(0, 512, 40).astype(np.int32)
        params = SamplingParams(temperature=0.0, max_new_tokens=300)
        expected = EngineClient(procs[0].address).generate("ref", CallMeta(), prompt, params).output_ids
        before = reprefills()

        pieces, reports = [], []
        drainer: threading.Thread | None = None
        for piece in client.generate_stream(CallMeta(execution_id="ex-kill", call_id="c1"), prompt, params):
            pieces.append(piece)
            if drainer is None and sum(len(p.token_ids) for p in pieces) >= 16:
                busy = next(e.cell_id for e in client.list_engines() if e.in_flight > 0)
                victim = next(p for p in procs if p.cell_id == busy)
                victim.kill()
                # The scheduler may also drain the dead cell: it reports the re-prefill.
                drainer = threading.Thread(target=lambda: reports.extend(client.drain_engine(busy)))
                drainer.start()
        assert drainer is not None
        drainer.join(timeout=60)

        ids, _lps, last = collect(pieces)
        assert last.finished and last.finish_reason == "length"
        np.testing.assert_array_equal(ids, expected)
        assert reprefills() == before + 1
        report: MigrationReport = next(r for r in reports if r.transport == "reprefill")
        assert report.ok and report.source_cell_id == busy and report.target_cell_id != busy
        assert report.kv_tokens >= len(prompt) + 16
        rec = next(r for r in gw.records if r.execution_id == "ex-kill")
        np.testing.assert_array_equal(rec.output_ids, expected)
        # The dead cell is gone from routing; new calls still work.
        assert [e.cell_id for e in client.list_engines()] == [p.cell_id for p in procs if p is not victim]
        again = client.generate(CallMeta(execution_id="ex-after"), prompt, SamplingParams(temperature=0.0,
                                                                                          max_new_tokens=8))
        np.testing.assert_array_equal(again.output_ids, expected[:8])
    finally:
        gw.stop()
        for p in procs:
            p.kill()
        time.sleep(0)

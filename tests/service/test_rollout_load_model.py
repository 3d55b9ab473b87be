"""Engine.LoadModel (a job's model replaces the served one): bad input gets a precise status and
leaves the engine serving its model; a busy engine refuses; an idle one switches and serves."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch

from protos.gyre.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.server import build_server
from services.rollout.host import EngineHost
from services.rollout.servicer import EngineServicer
from services.rollout.torch_engine import TorchEngine, build_tiny_model
from tests.support.waiting import wait_until

torch.set_num_threads(1)
Code = grpc.StatusCode


def _engine() -> TorchEngine:
    return TorchEngine(build_tiny_model(), device="cpu", max_context=1024, max_batch_size=4)


def _loader(model: str) -> TorchEngine:
    if model != "other-tiny":
        raise ValueError(f"model {model!r} does not resolve")
    return _engine()


@pytest.fixture
def engine() -> Iterator[tuple[rollout_pb2_grpc.EngineStub, EngineHost]]:
    host = EngineHost(_engine(), cell_id="cell-l", kv_kinds=("tcp",), model="first-tiny", loader=_loader)
    server = build_server("engine-l", [(rollout_pb2_grpc.add_EngineServicer_to_server, EngineServicer(host))],
                          service_names=["gyre.v1.Engine"])
    host.address = server.address
    host.start()
    server.start()
    server.set_serving(True)
    with grpc.insecure_channel(server.address) as ch:
        yield rollout_pb2_grpc.EngineStub(ch), host
    server.stop(0)
    host.stop()


def _gen(max_new_tokens: int = 4) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(context=common_pb2.CallContext(execution_id="e", call_id="c"),
                                       prompt_ids=[1, 2, 3],
                                       sampling=common_pb2.SamplingParams(temperature=0.0,
                                                                          max_new_tokens=max_new_tokens))


def _refused(stub: rollout_pb2_grpc.EngineStub, model: str) -> tuple[Code, str]:
    with pytest.raises(grpc.RpcError) as info:
        stub.LoadModel(rollout_pb2.LoadModelRequest(model=model), timeout=30)
    return info.value.code(), info.value.details()


def test_bad_models_are_refused_and_the_engine_keeps_serving(engine: tuple) -> None:
    stub, _host = engine
    assert _refused(stub, "") == (Code.INVALID_ARGUMENT, "model is required: a model name or a checkpoint directory")
    code, msg = _refused(stub, "/no/such/model")
    assert code == Code.INVALID_ARGUMENT and "does not resolve" in msg
    assert stub.GetLoad(rollout_pb2.GetLoadRequest()).model == "first-tiny"
    assert len(stub.Generate(_gen(), timeout=60).output_ids) >= 1
    assert stub.LoadModel(rollout_pb2.LoadModelRequest(model="first-tiny")).changed is False


def test_a_busy_engine_refuses_and_an_idle_one_loads(engine: tuple) -> None:
    stub, host = engine
    stream = stub.GenerateStream(_gen(max_new_tokens=900), timeout=120)
    wait_until(lambda: host.engine.active_requests(), 60, "the request to start")
    code, msg = _refused(stub, "other-tiny")
    assert code == Code.FAILED_PRECONDITION and "hosts 1 requests" in msg
    stream.cancel()
    wait_until(lambda: not host.engine.active_requests(), 60, "the cancelled request to be let go")
    res = stub.LoadModel(rollout_pb2.LoadModelRequest(model="other-tiny"), timeout=60)
    assert res.changed and res.model == "other-tiny"
    assert stub.GetLoad(rollout_pb2.GetLoadRequest()).model == "other-tiny"
    assert len(stub.Generate(_gen(), timeout=60).output_ids) >= 1

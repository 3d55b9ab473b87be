"""Bad input gets a precise gRPC status and a clear message (raw stubs: the status itself is checked)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch

from protos.gyre.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from tests.support.rollout_cluster import LocalEngine, LocalGateway, start_engine, start_gateway

torch.set_num_threads(1)
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def stubs() -> Iterator[tuple[rollout_pb2_grpc.GatewayStub, rollout_pb2_grpc.EngineStub, LocalGateway]]:
    engine: LocalEngine = start_engine("cell-a")
    gw = start_gateway(max_message_mb=1)
    gw.client().register_engine("cell-a", engine.address)
    gch, ech = grpc.insecure_channel(gw.address), grpc.insecure_channel(engine.address)
    yield rollout_pb2_grpc.GatewayStub(gch), rollout_pb2_grpc.EngineStub(ech), gw
    gch.close()
    ech.close()
    gw.stop()
    engine.stop()


def req(prompt: list[int] | None = None, **sampling: object) -> rollout_pb2.GenerateRequest:
    params = {"temperature": 0.0, "max_new_tokens": 4, **sampling}
    return rollout_pb2.GenerateRequest(context=common_pb2.CallContext(execution_id="ex-bad", call_id="c"),
                                       prompt_ids=[1, 2, 3] if prompt is None else prompt,
                                       sampling=common_pb2.SamplingParams(**params))


def status(call: object, *args: object) -> tuple[Code, str]:
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, timeout=30)  # type: ignore[operator]
        if not isinstance(result, rollout_pb2.GenerateResponse) and hasattr(result, "__iter__"):
            list(result)
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("target", ["gateway", "engine"])
def test_generate_rejects_bad_calls_precisely(stubs: tuple, target: str) -> None:
    gw_stub, engine_stub, _ = stubs
    stub = gw_stub if target == "gateway" else engine_stub
    for method in (stub.Generate, stub.GenerateStream):
        code, msg = status(method, req([1, 2, 512]))
        assert code == Code.INVALID_ARGUMENT and "512" in msg and "vocabulary" in msg
        code, msg = status(method, req([1] * 1100))
        assert code == Code.INVALID_ARGUMENT and "1100 tokens" in msg and "context of 1024" in msg
        code, msg = status(method, req([]))
        assert code == Code.INVALID_ARGUMENT and "empty" in msg
        code, msg = status(method, req(temperature=-1.0))
        assert code == Code.INVALID_ARGUMENT and "temperature" in msg
        code, msg = status(method, req(max_new_tokens=0))
        assert code == Code.INVALID_ARGUMENT and "max_new_tokens" in msg
        code, msg = status(method, req(top_p=1.5))
        assert code == Code.INVALID_ARGUMENT and "top_p" in msg
        code, msg = status(method, req(stop_token_ids=[9999]))
        assert code == Code.INVALID_ARGUMENT and "stop_token_ids" in msg
        bad_role = req()
        bad_role.context.role = 42
        code, msg = status(method, bad_role)
        assert code == Code.INVALID_ARGUMENT and "role" in msg


def test_gateway_rejects_unknown_sessions_engines_and_oversized_messages(stubs: tuple) -> None:
    gw_stub, _, _ = stubs
    delta = req([])
    delta.prompt_delta.base_call_id = "never-made"
    delta.prompt_delta.shared_prefix_len = 3
    delta.prompt_delta.new_ids.extend([4, 5])
    code, msg = status(gw_stub.Generate, delta)
    assert code == Code.NOT_FOUND and "unknown session" in msg and "never-made" in msg
    both = req([1, 2])
    both.prompt_delta.new_ids.extend([4])
    code, msg = status(gw_stub.Generate, both)
    assert code == Code.INVALID_ARGUMENT and "not both" in msg
    code, msg = status(gw_stub.DrainEngine, rollout_pb2.DrainEngineRequest(cell_id="cell-zz"))
    assert code == Code.NOT_FOUND and "cell-zz" in msg
    code, msg = status(gw_stub.DeregisterEngine, rollout_pb2.DeregisterEngineRequest(cell_id="cell-zz"))
    assert code == Code.NOT_FOUND and "cell-zz" in msg
    code, msg = status(gw_stub.RegisterEngine, rollout_pb2.RegisterEngineRequest(cell_id="x", address="nohost"))
    assert code == Code.INVALID_ARGUMENT and "host:port" in msg
    code, _msg = status(gw_stub.Generate, req([500] * 600_000))  # ~1.2 MB packed > the 1 MiB limit
    assert code == Code.RESOURCE_EXHAUSTED


def test_engine_rejects_unknown_requests_and_bad_weights(stubs: tuple) -> None:
    _, engine_stub, _ = stubs
    code, msg = status(engine_stub.Attach, rollout_pb2.AttachRequest(request_id="ghost", wait_s=0.05))
    assert code == Code.NOT_FOUND and "ghost" in msg
    code, msg = status(engine_stub.MigrateOut, rollout_pb2.MigrateOutRequest(request_ids=["x"]))
    assert code == Code.INVALID_ARGUMENT and "target_address" in msg
    delta = req()
    delta.prompt_delta.new_ids.extend([1])
    code, msg = status(engine_stub.Generate, delta)
    assert code == Code.INVALID_ARGUMENT and "prompt_delta" in msg
    chunk = common_pb2.WeightChunk(version=1, name="model.norm.weight", dtype="float77", shape=[64],
                                   data=b"\0" * 256, total_bytes=256, last=True)
    code, msg = status(engine_stub.UpdateWeights, iter([chunk]))
    assert code == Code.INVALID_ARGUMENT and "float77" in msg
    chunk = common_pb2.WeightChunk(version=1, name="no.such.param", dtype="float32", shape=[64],
                                   data=b"\0" * 256, total_bytes=256, last=True)
    code, msg = status(engine_stub.UpdateWeights, iter([chunk]))
    assert code == Code.INVALID_ARGUMENT and "no.such.param" in msg
    partial = common_pb2.WeightChunk(version=1, name="model.norm.weight", dtype="float32", shape=[64],
                                     data=b"\0" * 128, total_bytes=256, last=True)
    code, msg = status(engine_stub.UpdateWeights, iter([partial]))
    assert code == Code.INVALID_ARGUMENT and "incomplete" in msg


def test_no_engine_available_is_unavailable() -> None:
    gw = start_gateway()
    try:
        stub = rollout_pb2_grpc.GatewayStub(grpc.insecure_channel(gw.address))
        code, msg = status(stub.Generate, req())
        assert code == Code.UNAVAILABLE and "no rollout engine" in msg
    finally:
        gw.stop()

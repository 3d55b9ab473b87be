"""Contexts past 1K through the real gateway: 64K positions served over HTTP and gRPC, TITO recorded
whole, and a prompt beyond the model's positions refused with the limit named."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer

from services.common.errors import InvalidArgument
from services.rollout.calls import CallMeta
from services.rollout.engine import SamplingParams
from services.rollout.http_async import AsyncOpenAIServer
from services.rollout.openai_http import OpenAIEndpoint
from services.rollout.torch_engine import build_tiny_model
from tests.support.rollout_cluster import LocalEngine, LocalGateway, start_engine, start_gateway
from tests.support.rollout_tokenizer import make_chatml_tokenizer

torch.set_num_threads(1)
POSITIONS = 65_536


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AsyncOpenAIServer, LocalGateway, LocalEngine]]:
    tok = AutoTokenizer.from_pretrained(str(make_chatml_tokenizer(tmp_path_factory.mktemp("tok"))))
    engine = start_engine("cell-long", model=build_tiny_model(max_position_embeddings=POSITIONS),
                          max_context=POSITIONS)
    gw = start_gateway()
    gw.client().register_engine("cell-long", engine.address)
    server = AsyncOpenAIServer(OpenAIEndpoint(gw.gateway, tokenizer=tok, model_name="gyre-long", job_id="job-l"),
                          max_body_bytes=4 << 20).start()
    yield server, gw, engine
    server.stop()
    gw.stop()
    engine.stop()


def test_an_execution_grows_past_32k_tokens_over_http(stack: tuple[AsyncOpenAIServer, LocalGateway, LocalEngine]) -> None:
    server, gw, engine = stack
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
    rng = np.random.default_rng(0)
    context: list[int] = []
    cached = []
    for turn, new in enumerate((2_000, 14_000, 24_000)):  # 2K -> 16K -> 40K tokens of context
        context += rng.integers(1, 500, new).tolist()
        out = client.completions.create(model="gyre-long", prompt=context, max_tokens=4, temperature=0.0,
                                        extra_headers={"x-gyre-execution-id": "ex-long", "x-gyre-agent-id": "main"})
        assert out.usage is not None and out.usage.prompt_tokens == len(context)
        assert out.usage.completion_tokens == 4
        assert out.usage.prompt_tokens_details is not None
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    # as OpenAI reports it: the prompt tokens served from the engine's prefix cache
    assert cached[0] == 0 and cached[1] >= 2_000 and cached[2] >= 16_000
    records = [r for r in gw.records if r.execution_id == "ex-long"]
    assert len(records) == 3 and len(records[-1].prompt_ids) == len(context) > 32_768
    # calls 2 and 3 found their context's first 2K and 16K tokens in the engine's prefix cache
    stats = engine.host.engine.prefix_stats()
    assert stats["reused_tokens"] >= 2_000 + 16_000
    assert stats["prefilled_tokens"] <= stats["prompt_tokens"] - 18_000


def test_a_prompt_beyond_the_positions_is_refused_naming_the_limit(
        stack: tuple[AsyncOpenAIServer, LocalGateway, LocalEngine]) -> None:
    server, gw, _ = stack
    too_long = [7] * (POSITIONS + 10)
    request = urllib.request.Request(f"{server.base_url}/completions", method="POST",
                                     data=json.dumps({"prompt": too_long, "max_tokens": 2}).encode(),
                                     headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    body: dict[str, Any] = json.loads(info.value.read())
    assert info.value.code == 400 and f"model context of {POSITIONS} tokens" in body["error"]["message"]
    with pytest.raises(InvalidArgument, match=f"{POSITIONS + 10} tokens.*context of {POSITIONS}"):
        gw.client().generate(CallMeta(job_id="j", execution_id="ex-2", call_id="c0", agent_id="a"),
                             np.asarray(too_long, np.int32), SamplingParams(temperature=0.0, max_new_tokens=2))
    # the service is up and serves the next call
    ok = gw.client().generate(CallMeta(job_id="j", execution_id="ex-3", call_id="c0", agent_id="a"),
                              np.arange(1, 100, dtype=np.int32), SamplingParams(temperature=0.0, max_new_tokens=2))
    assert len(ok.output_ids) == 2

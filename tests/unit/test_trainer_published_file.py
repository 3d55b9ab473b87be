"""A sharded group's published versions: safetensors files written a tensor at a time and read back
one tensor at a time; the safetensors library reads them as its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.common.weights import chunk_state_dict
from services.trainer.weights import PublishedFile, SafetensorsWriter, WeightStore, assemble, state_bytes


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(7, 5, generator=g), "layer.0.w": torch.randn(3, generator=g).bfloat16(),
            "steps": torch.arange(4, dtype=torch.int64), "mask": torch.tensor([True, False, True]),
            "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5, dtype=torch.float16)}


def _write(path: Path, state: dict[str, torch.Tensor], order: list[str]) -> Path:
    w = SafetensorsWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in state.items()])
    for name in order:
        w.write(name, state[name])
    return w.close()


def test_a_file_written_a_tensor_at_a_time_in_any_order_reads_back_exactly(tmp_path: Path) -> None:
    state = _state()
    path = _write(tmp_path / "v1.safetensors", state, list(reversed(state)))
    assert not (tmp_path / "v1.safetensors.part").exists()
    theirs = load_file(str(path))  # the library's own reader
    published = PublishedFile(path)
    assert list(published) == list(state) and len(published) == len(state)
    assert published.nbytes == state_bytes(state)
    for name, t in state.items():
        assert theirs[name].dtype == t.dtype and torch.equal(theirs[name], t), name
        assert torch.equal(published[name], t), name
    with pytest.raises(KeyError):
        published["nope"]
    # streamed as a version (what GetWeights and the engine push send), assembled as written
    version, got = assemble(chunk_state_dict(published, 3, chunk_bytes=16))
    assert version == 3 and all(torch.equal(got[n], state[n]) for n in state)


def test_an_incomplete_or_mis_sized_file_is_never_published(tmp_path: Path) -> None:
    state = _state()
    w = SafetensorsWriter(tmp_path / "v.safetensors", [(n, t.dtype, tuple(t.shape)) for n, t in state.items()])
    with pytest.raises(ValueError, match="has 28 bytes; its header says 140"):
        w.write("embed.weight", torch.zeros(7))
    w.write("embed.weight", state["embed.weight"])
    with pytest.raises(ValueError, match="5 tensors were never written"):
        w.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="safetensors cannot hold"):
        SafetensorsWriter(tmp_path / "c.safetensors", [("z", torch.complex64, (2,))])


def test_the_store_removes_a_file_with_its_version(tmp_path: Path) -> None:
    store = WeightStore(keep=2)
    state = _state()
    paths = [_write(tmp_path / f"v{v}.safetensors", state, list(state)) for v in range(3)]
    for v, path in enumerate(paths):
        assert store.publish_state(PublishedFile(path), v).path == path  # type: ignore[attr-defined]
    assert not paths[0].exists() and paths[1].exists() and paths[2].exists()
    assert torch.equal(store.get(-1)["embed.weight"], state["embed.weight"])
    store.reset()
    assert not any(p.exists() for p in paths)

"""`gyre run` writes the trained policy as a model directory (services.run.save_policy): the base
model's config and tokenizer with the trainer's last checkpoint's weights, which transformers,
`resolve_model` (so `gyre run --model DIR`) and the held-out bench load as they are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.run import POLICY_FILE, save_policy


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.task.model import BuiltinModelSpec, ensure_builtin_model

    spec = BuiltinModelSpec(demo_tasks=40, snippet_steps=20, sft_steps=20, batch_size=16)
    return ensure_builtin_model(tmp_path_factory.mktemp("models"), spec=spec)


def _trained_checkpoint(base: Path, root: Path, *, version: int, scale: float) -> dict[str, torch.Tensor]:
    """A real trainer checkpoint of ``base``'s model with every weight moved (as a step would)."""
    from transformers import AutoModelForCausalLM

    from services.trainer.checkpoint import save_checkpoint

    model = AutoModelForCausalLM.from_pretrained(str(base))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    save_checkpoint(root, step=version, version=version, model=model, optimizer=opt)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_policy_dir_loads_with_the_checkpoint_weights(base_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.models.source import resolve_model

    root = tmp_path / "checkpoints" / "job-1"
    _trained_checkpoint(base_dir, root, version=1, scale=0.1)
    want = _trained_checkpoint(base_dir, root, version=2, scale=0.1)  # the newest one is the policy
    out = save_policy(root, base_dir, tmp_path / "report" / "policy", job_id="job-1")

    assert out == tmp_path / "report" / "policy" and resolve_model(str(out)) == out.resolve()
    info = json.loads((out / POLICY_FILE).read_text())
    assert info["job_id"] == "job-1" and info["weight_version"] == 2 and info["checkpoint"].endswith("step-000002")
    assert not (out / "gyre_build.json").exists()  # the base's build stamp is not this model's
    got = AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir)).state_dict()
    assert not all(torch.equal(base[k], want[k]) for k in want)  # not the base model's weights
    assert AutoTokenizer.from_pretrained(str(out)).encode("m1 add 2") == \
        AutoTokenizer.from_pretrained(str(base_dir)).encode("m1 add 2")
    assert not list(out.parent.glob(".policy.*"))  # no temporary directory left beside it


def test_a_later_policy_replaces_the_earlier_one(base_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "policy"
    save_policy(_ckpt(base_dir, tmp_path / "a", 1), base_dir, out, job_id="job-a")
    save_policy(_ckpt(base_dir, tmp_path / "b", 3), base_dir, out, job_id="job-b")
    info = json.loads((out / POLICY_FILE).read_text())
    assert (info["job_id"], info["weight_version"]) == ("job-b", 3) and "base_policy" not in info
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "policy"]
    # trained on from that policy (`gyre run --model policy`): the new record keeps the lineage
    later = save_policy(_ckpt(out, tmp_path / "c", 1), out, tmp_path / "policy2", job_id="job-c")
    assert later is not None
    info = json.loads((later / POLICY_FILE).read_text())
    assert info["job_id"] == "job-c" and info["base_policy"]["job_id"] == "job-b"


def test_no_checkpoint_no_policy(base_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert save_policy(tmp_path / "empty", base_dir, tmp_path / "policy", job_id="j") is None
    assert save_policy(tmp_path / "missing", base_dir, tmp_path / "policy", job_id="j") is None
    assert not (tmp_path / "policy").exists()


def _ckpt(base: Path, root: Path, version: int) -> Path:
    _trained_checkpoint(base, root, version=version, scale=0.01)
    return root

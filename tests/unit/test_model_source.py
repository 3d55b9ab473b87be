"""Model names resolve to local checkpoints; bad names and dirs give one clear sentence."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.models.source import resolve_model, smollm2_gguf_path


def test_local_dir_and_errors(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "ckpt")) == (tmp_path / "ckpt").resolve()
    with pytest.raises(ValueError, match="unknown model 'gpt-99'"):
        resolve_model("gpt-99")


def test_smollm2_gguf_is_shipped_by_the_package() -> None:
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000

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


def test_named_models_come_from_the_packages_that_build_them() -> None:
    """builtin-tiny and builtin-tools are registered by the task package (pyproject's ``gyre.models``
    entry points) and found without services.models importing it: no module of services/models
    imports services.task, at module level or inside a function."""
    import ast

    from services.models.source import model_builders, named_models
    from services.task.model import ensure_builtin_model
    from services.task.tool_model import ensure_tool_model

    assert named_models() == ("builtin-tiny", "builtin-tools", "smollm2-135m-instruct")
    builders = model_builders()
    assert builders["builtin-tiny"].load() is ensure_builtin_model
    assert builders["builtin-tools"].load() is ensure_tool_model
    upward = []
    for path in sorted((Path(__file__).resolve().parents[2] / "services" / "models").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            upward += [f"{path.name}: {n}" for n in names if n.startswith("services.task")]
    assert not upward, upward

"""Config loading: precedence, type checks and the one-sentence errors users see."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from services.common.config import ServerConfig, check, load_config, setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig(ServerConfig):
    max_paths: int = setting(8, "Paths kept per execution.")
    ratio: float = setting(0.5, "A float knob.")
    names: tuple[str, ...] = setting(("a",), "A list knob.")
    budget_tokens: int | None = setting(None, "Optional budget.")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.max_paths >= 1, "max_paths", self.max_paths, "at least 1")


def test_precedence_toml_env_argv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[common]\nredis_url = "redis://h:1/0"\n[demo]\nmax_paths = 3\nratio = 2\nnames = ["x", "y"]\n')
    monkeypatch.setenv("GYRE_DEMO_MAX_PATHS", "4")
    cfg = load_config(DemoConfig, path=toml, section="demo", env_prefix="GYRE_DEMO_", argv=["--port", "5", "--log-json"])
    assert cfg.max_paths == 4
    assert cfg.ratio == 2.0 and isinstance(cfg.ratio, float)
    assert cfg.names == ("x", "y")
    assert cfg.redis_url == "redis://h:1/0"
    assert cfg.port == 5 and cfg.log_json is True
    cfg2 = load_config(DemoConfig, argv=["--budget-tokens", "none", "--names", "p,q", "--max-paths=9"])
    assert cfg2.budget_tokens is None and cfg2.names == ("p", "q") and cfg2.max_paths == 9


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"argv": ["--max-paths", "zero"]}, "config field 'max_paths' from flag --max-paths is 'zero'; expected int"),
        ({"argv": ["--max-paths", "0"]}, "config field 'max_paths' is 0; expected at least 1"),
        ({"argv": ["--bogus", "1"]}, "unknown flag --bogus"),
        ({"argv": ["--port"]}, "flag --port needs a value"),
        ({"argv": ["--port", "70000"]}, "config field 'port' is 70000"),
        ({"argv": ["--redis-url", "http://x"]}, "expected a redis://"),
        ({"overrides": {"ratio": "high"}}, "config field 'ratio' from overrides is 'high' (str); expected float"),
    ],
)
def test_bad_values_give_one_clear_sentence(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        load_config(DemoConfig, **kwargs)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_config(DemoConfig, path=tmp_path / "missing.toml", section="demo")
    bad = tmp_path / "bad.toml"
    bad.write_text("[demo\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(DemoConfig, path=bad, section="demo")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[demo]\nmax_pathz = 3\n")
    with pytest.raises(ValueError, match="unknown field 'max_pathz'"):
        load_config(DemoConfig, path=unknown, section="demo")


def test_mutable_defaults_refused() -> None:
    with pytest.raises(TypeError):
        setting([1], "no")

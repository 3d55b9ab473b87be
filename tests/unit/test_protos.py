"""Every contract generates and imports together in one descriptor pool (no name clashes in gyre.v1)."""

from __future__ import annotations

import importlib
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parents[2] / "protos" / "gyre" / "v1"


def test_all_protos_import_together() -> None:
    names = sorted(p.stem for p in PROTO_DIR.glob("*.proto"))
    assert {"common", "rollout", "scheduler", "trainer", "trajectory"} <= set(names)
    services = {}
    for name in names:
        mod = importlib.import_module(f"protos.gyre.v1.{name}_pb2")
        importlib.import_module(f"protos.gyre.v1.{name}_pb2_grpc")
        assert mod.DESCRIPTOR.package == "gyre.v1"
        services.update({s.full_name: s for s in mod.DESCRIPTOR.services_by_name.values()})
    for required in ("gyre.v1.Scheduler", "gyre.v1.Engine", "gyre.v1.Gateway", "gyre.v1.Trainer", "gyre.v1.Trajectory"):
        assert required in services, f"missing service {required}"
        assert services[required].methods, f"{required} has no RPCs"

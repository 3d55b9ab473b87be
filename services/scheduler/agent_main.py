"""Former name of ``services.scheduler.daemon_main`` (the cell daemon was called the cell agent
before 0.x's rename): a unit or script that still runs ``python -m services.scheduler.agent_main``
starts the cell daemon. New deployments use ``gyre-cell-daemon`` / ``services.scheduler.daemon_main``."""

from __future__ import annotations

from services.scheduler.daemon_main import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())

"""A process serving only health + reflection through the shared bootstrap (for bootstrap tests).

Usage: python -m tests.support.bare_server PORT_FILE
Writes its port to PORT_FILE once SERVING; stops gracefully on SIGTERM and exits 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

from services.common.logging import setup_logging
from services.common.server import build_server, serve


def main() -> None:
    setup_logging(json=True, service="bare")
    server = build_server("bare", [], service_names=[]).start()
    server.set_serving(True)
    Path(sys.argv[1]).write_text(str(server.port))
    serve(server, grace_s=2.0, on_shutdown=lambda: print("handing off", flush=True))


if __name__ == "__main__":
    main()

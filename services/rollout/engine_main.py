"""``gyre-engine``: a ROLLOUT cell serving the rollout ``Engine`` gRPC service (see main.py)."""

import sys

from services.rollout.main import engine_main

if __name__ == "__main__":
    sys.exit(engine_main())

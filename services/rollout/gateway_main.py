"""``gyre-gateway``: the rollout ``Gateway`` gRPC service + OpenAI-compatible HTTP (see main.py)."""

import sys

from services.rollout.main import gateway_main

if __name__ == "__main__":
    sys.exit(gateway_main())

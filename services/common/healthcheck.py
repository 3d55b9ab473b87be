"""gRPC health probe for container healthchecks and scripts.

    python -m services.common.healthcheck 127.0.0.1:50051 [SERVICE] [--timeout-s 3]

Exit 0 when SERVING, 1 otherwise (with one line saying why). TLS when ``GYRE_TLS_CA_FILE`` names the
CA the service's certificate is checked against (health itself needs no token).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.security import configure_client_from_env, open_channel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gyre-healthcheck")
    parser.add_argument("address")
    parser.add_argument("service", nargs="?", default="")
    parser.add_argument("--timeout-s", type=float, default=3.0)
    args = parser.parse_args(argv)
    configure_client_from_env()
    with open_channel(args.address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s)
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}")
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())

"""Gyre scheduler: cell roles (policy), run queue and job state in Redis, gRPC API, simulator."""

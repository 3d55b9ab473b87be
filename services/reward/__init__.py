"""Reward service: stores untrusted workspace snapshots, scores executions with pluggable
scorers (sandboxed built-in / entry point, or an external harness's gRPC scorer), applies the
job's timeout policy and reports outcomes to the trajectory service."""

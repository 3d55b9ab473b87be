"""The built-in harness process (gyre-harness): leases executions from the scheduler, runs each
task family's runner against the rollout gateway, and sends the workspace to reward.

    harness.py      Harness: execution threads, leases, heartbeats, scoring, completion; main()
    config.py       HarnessConfig (TOML [harness], GYRE_HARNESS_*, --flags)

It sits above the services it talks to (scheduler, rollout, reward: through their gRPC clients)
and above the task package, whose runners it calls through services.task.runner.RunnerHost.
"""

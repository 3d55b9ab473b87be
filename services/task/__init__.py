"""Gyre's task families (the built-in XLong family, arith-v1, ...) and their agents.

    registry.py     TaskFamily and the family table: what the scheduler, reward and harness name
                    (light to import: dotted paths, resolved late)
    families/       one module per family, each declaring FAMILY = TaskFamily(...)
    arith.py        arith-v1: multi-turn arithmetic chat for real instruct models
    dsl.py          GyreStack, the tiny stack language modules are written in (safe interpreter)
    spec.py         task generator: "build a small repo" of modules with tests, from a task id
    prompts.py      every segment of text the agent shows the model
    tokenizer.py    the word-level tokenizer (HF directory with chat template)
    agent.py        one execution: steps, tests, fixes, retries, sub-agents, compaction, timeout
    scoring.py      grading a workspace against all tests (what "pass rate" means)
    demos.py        scripted demonstrations for the warm start
    model.py        the tiny policy: config, supervised warm start, ensure_builtin_model()
    local_client.py an in-process ModelClient (evaluation, tests)
    evaluate.py     held-out pass rate of a policy through any ModelClient (greedy by default)
    runner.py       RunOutcome and RunnerHost: what a family's runner gets from the harness and returns
    gateway_client.py  GatewayModelClient: a ModelClient over the rollout gateway (TITO gRPC)
    traces.py       execution traces (JSONL): the trace-v1 family's and the simulator's workload

The harness process that runs these agents for jobs is services/harness (it imports this
package; nothing here imports it).
"""

"""Trajectory service: TITO records -> per-execution token trees -> packed tree micro-batches.

Who calls what (``client.TrajectoryClient``; contract in protos/gyre/v1/trajectory.proto)::

    gateway    ingest(records)                     delta-encoded (records.DeltaEncoder) or full prompts
    reward     complete_execution(outcome)         group, reward, step, excluded
    scheduler  open_step(job, s, num_executions=G*n, group_size=n)   before/while step s rolls out
               close_step(job, s)                  only if not every execution reports an outcome
    trainer    for b in stream_batches(job, s, consumer_id): train(b.batch); ack(job, s, b.batch_id, ...)

Core modules (no gRPC): ``records`` (domain records, JSONL, DeltaEncoder), ``trie`` (flat-array
token trie), ``tree`` (per-execution tree: trainable nodes, path selection, DFS layout),
``advantages`` (GRPO), ``packing`` (PackedBatch, subtree splitting, micro-batches), ``steps``
(step work queue), ``store`` (Redis index + blob spool), ``api`` (the service logic, ``TrajectoryApi``).
Adapters: ``wire`` (proto <-> domain), ``servicer``, ``client``; entry points: ``main``
(``python -m services.trajectory.main``) and ``cli`` (``gyre trajectory stats``).
Benchmark: ``python -m bench.bench_trajectory``.
"""

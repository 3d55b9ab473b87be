"""Trajectory service: TITO records -> per-execution token tries -> packed tree micro-batches.

Core modules (no gRPC): ``records`` (domain records, JSONL, DeltaEncoder), ``trie`` (flat-array
token trie), ``tree`` (per-execution tree with trainable nodes, path selection), ``advantages``,
``packing`` (PackedBatch, subtree splitting, micro-batches), ``steps`` (step work queues),
``store`` (Redis index + blob spool), ``core`` (the service logic). Adapters: ``servicer``,
``client``; entry points: ``main``, ``cli``.
"""

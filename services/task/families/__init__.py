"""Task family declarations, one module per family (services.task.registry registers each one).

    xlong.py     xlong-v1   build a small repo of GyreStack modules (services.task.spec, agent, scoring)
    arith.py     arith-v1   multi-turn arithmetic chat for real instruct models (services.task.arith)
    numbered.py  numbered   numbered payloads for tests and demos (no scorer, no harness)

A module here declares ``FAMILY = TaskFamily(...)`` with dotted paths and nothing heavy at module
level: the registry imports every module of this package on its first lookup, in the scheduler
too. Code that needs numpy, torch or a tokenizer is imported inside the functions.
"""

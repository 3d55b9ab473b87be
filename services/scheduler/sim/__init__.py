"""The offline side of the scheduler: a discrete-event simulator of a Gyre cluster driven by the
live policy (``services.scheduler.policy.decide``), its cost model, the lower bound of a trace's
makespan, the mode comparison, and ``gyre bench scheduler``. Nothing here runs in a live service.
"""

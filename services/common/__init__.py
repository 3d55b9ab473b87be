"""Shared service core: config, logging, server bootstrap, Redis access, blob spool, metrics.

Light to import: nothing here imports torch.
"""

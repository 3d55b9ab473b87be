"""Gyre's services.

grpc's and torch's C++ cores log to stderr outside Python's logging (plain text, not JSON) and read
their verbosity once, when they are imported: every Gyre process, however it is started (the
launcher, a systemd unit, a cell agent's train command), keeps them to errors unless the
environment says otherwise (``GRPC_VERBOSITY``, ``TORCH_CPP_LOG_LEVEL``).
"""

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

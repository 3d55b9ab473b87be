"""Gyre's services.

grpc's and torch's C++ cores log to stderr outside Python's logging (plain text, not JSON) and read
their verbosity once, when they are imported: every Gyre process, however it is started (the
launcher, a systemd unit, a cell daemon's train command), keeps them to errors unless the
environment says otherwise (``GRPC_VERBOSITY``, ``TORCH_CPP_LOG_LEVEL``). ``SET_HERE`` names the
ones set here, so the scorer sandbox's worker can take them out again: the code it runs sees
exactly the sandbox's environment.
"""

import os

_QUIET = {"GRPC_VERBOSITY": "ERROR", "TORCH_CPP_LOG_LEVEL": "ERROR"}
SET_HERE = tuple(k for k in _QUIET if k not in os.environ)
for _key in SET_HERE:
    os.environ[_key] = _QUIET[_key]

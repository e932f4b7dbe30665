"""Test set-up: the XLA CPU device, and imports from the repository root and this folder."""
from __future__ import annotations

import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _path in (_ROOT, _HERE):  # the packages (also when not pip-installed) and tests/harness.py
    if _path not in sys.path:
        sys.path.insert(0, _path)

# The autograd engine sizes its per-device queues at the first backward(), from the devices known then; a test
# that trains on CPU before the XLA device exists would make every later backward() on it fail (engine.cpp
# "device_ready_queues_" assert). So the XLA device is brought up first. Ranks come from a forkserver: this
# process's runtime is not inherited.
try:
    import torch_xla  # noqa: E402

    torch_xla.device()
except ImportError:
    pass

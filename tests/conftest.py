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

"""scripts/train_demo.py run on gloo ranks (run_ranks) for the multi-rank tests that train, save and resume
the demo's Llama: the run's JSON report back as a dict."""
from __future__ import annotations

import json
import os
import sys
from typing import List

from harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")


def use_scripts() -> None:
    """Make scripts/ (train_demo, native_demo) importable in this process."""
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)


def demo_rank(rank, world, argv):
    """train_demo.main(argv) in a run_ranks process (gloo already initialized)."""
    use_scripts()
    import train_demo

    train_demo.main(argv)
    return True


def run_demo(argv: List[str], out, world: int = 4, timeout: float = 240) -> dict:
    """Run the demo with ``argv`` on ``world`` ranks, its report written to ``out``; return the report."""
    run_ranks(demo_rank, world, [*argv, "--out", str(out)], timeout=timeout)
    with open(out) as f:
        return json.load(f)

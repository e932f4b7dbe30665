"""The ``nxd-ckpt`` command. Subcommands are registered in later modules."""
from __future__ import annotations

import argparse
import sys

from ._version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nxd-ckpt",
        description="Inspect, verify, reshard and export nxd-ckpt / neuronx-distributed checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"nxd-ckpt {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    return args.func(args)


def convert_zero1_main(argv=None) -> int:
    raise SystemExit("convert-zero1 is not available yet")


if __name__ == "__main__":
    sys.exit(main())

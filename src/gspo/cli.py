"""The ``gspo`` command."""

from __future__ import annotations

import argparse

from gspo import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gspo", description=__doc__)
    parser.add_argument("--version", action="version", version=f"gspo {__version__}")
    parser.parse_args(argv)
    parser.print_help()
    return 0

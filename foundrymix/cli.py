"""``foundrymix`` command line: each subcommand registers itself beside the code it drives
(``register(subparsers)``), so this module only dispatches."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from foundrymix.errors import run_command

# module path -> registers one or more subcommands
SUBCOMMAND_MODULES = (
    'foundrymix.convert.cli',
    'foundrymix.tools.inspect',
    'foundrymix.tools.plan',
    'foundrymix.tools.migrate',
    'foundrymix.train.cli',
    'foundrymix.train.report',
    'foundrymix.tools.verify',
    'foundrymix.train.export',
    'foundrymix.tools.compare',
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog='foundrymix',
        description='Convert corpora to MDS shards, plan exact mixtures, train with Composer.')
    sub = parser.add_subparsers(dest='command', required=True, metavar='COMMAND')
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one subcommand; user-facing errors become one line (see :func:`foundrymix.errors.run_command`)."""
    return run_command(build_parser().parse_args(argv))


if __name__ == '__main__':
    sys.exit(main())

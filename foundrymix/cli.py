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
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # subcommand not built yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run(build_parser().parse_args(argv))


#: run a parsed subcommand; user-facing errors become one line (see foundrymix.errors)
run = run_command


if __name__ == '__main__':
    sys.exit(main())

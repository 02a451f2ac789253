"""``foundrymix`` command line: convert | inspect | verify | plan | train | report | export.

Each subcommand lives beside the code it drives and registers itself through a
``register(subparsers)`` function, so this module only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from foundrymix.errors import FoundrymixError

# module path -> registers one or more subcommands
SUBCOMMAND_MODULES = (
    'foundrymix.convert.cli',
    'foundrymix.inspect',
    'foundrymix.train.plan_cli',
    'foundrymix.train.cli',
    'foundrymix.train.report',
    'foundrymix.verify',
    'foundrymix.train.export',
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


def run(args: argparse.Namespace) -> int:
    """Run a parsed subcommand (``args.func``); user-facing errors become one line, exit 2."""
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print('interrupted', file=sys.stderr)
        return 130
    except (FoundrymixError, FileNotFoundError, FileExistsError, PermissionError) as e:
        # User-facing errors carry file/line/field in their message; no traceback. (An OS
        # error about a file names it.) Any other exception -- a ValueError included -- is a
        # bug, and keeps its traceback.
        print(f'foundrymix {args.command}: error: {e}', file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())

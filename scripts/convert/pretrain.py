"""Thin wrapper: `python scripts/convert/pretrain.py ARGS` == `foundrymix convert pretrain ARGS`."""

import sys

from foundrymix.cli import main

if __name__ == '__main__':
    sys.exit(main(['convert', 'pretrain', *sys.argv[1:]]))

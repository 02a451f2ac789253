"""Thin wrapper: `python scripts/convert/finetune.py ARGS` == `foundrymix convert finetune ARGS`."""

import sys

from foundrymix.cli import main

if __name__ == '__main__':
    sys.exit(main(['convert', 'finetune', *sys.argv[1:]]))

"""Train on a foundrymix stream mix: ``composer train.py yamls/demo.yaml [key=value ...]``.

Also runs as ``python train.py ...`` (one process) and ``foundrymix train ...``.
"""

import sys

from foundrymix.train.cli import main

if __name__ == '__main__':
    sys.exit(main())

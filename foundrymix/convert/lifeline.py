"""Forked worker processes end when the process that forked them dies, even by SIGKILL, so an
inherited ``flock`` on ``--out`` never keeps a rerun out (``PR_SET_PDEATHSIG``, else a polling thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: how often the fallback thread looks for its parent, in seconds
POLL_S = 0.2


def die_with_parent(parent: int) -> None:
    """Make this process (forked by ``parent``, in the thread that lives as long as the
    pool: ``PR_SET_PDEATHSIG`` follows the forking thread) end when ``parent`` does."""
    if sys.platform.startswith('linux'):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
            if os.getppid() != parent:  # died before the setting was made
                os._exit(1)
            return
    threading.Thread(target=_watch, args=(parent,), daemon=True, name='foundrymix-lifeline').start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os._exit(1)

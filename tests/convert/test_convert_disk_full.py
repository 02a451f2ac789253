"""A disk that fills up during ``convert`` is one line naming ``--out`` and the fix.

Was: the shard writer thread's ``OSError: [Errno 28] No space left on device`` as a
traceback naming no path. Two ways to fill the disk: a real 1 MB tmpfs mounted for the
test (needs root; skipped where mounting is not allowed) with the real command line in a
fresh process, and, on every machine, ``ENOSPC`` raised where the shard writer opens its
second shard file (our own module's ``open``, in process). Either way nothing is published
and nothing is left beside ``--out``.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys

import pytest

from foundrymix.cli import main
from helpers import SAMPLES

L = 128


def line(out: str, free: int) -> str:
    return (f'foundrymix convert: error: --out {out}: no space left on the device that holds it ({free:,} bytes '
            f'free now); nothing was published (the partial output was removed): free space there, or give '
            f'--out a folder on a disk with more room')


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs at ``tmp_path/small``, unmounted afterwards."""
    mnt = tmp_path / 'small'
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip('mounting a tmpfs needs root')
    proc = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', str(mnt)], capture_output=True)
    if proc.returncode:
        pytest.skip(f'cannot mount a tmpfs here: {proc.stderr.decode().strip()}')
    try:
        yield mnt
    finally:
        subprocess.run(['umount', str(mnt)], check=True)


def test_a_full_disk_is_one_line_naming_out(small_disk, tmp_path):
    """Three copies of the arXiv sample are ~2.4 MB of uint16 rows: more than the 1 MB disk."""
    big = tmp_path / 'big.jsonl'
    big.write_bytes((SAMPLES / 'arxiv_sample.jsonl').read_bytes() * 3)
    out = small_disk / 'out'
    for extra in ([], ['--workers', '2', '--size-limit', '64kb']):  # a shard's open, or a write into one
        proc = subprocess.run([sys.executable, '-m', 'foundrymix.cli', 'convert', 'pretrain', str(big), '-o',
                               str(out), '--max-seq-len', str(L), '--no-progress', *extra],
                              capture_output=True, text=True, timeout=600)
        assert (proc.returncode, proc.stderr.splitlines()) == (2, [line(str(out), 1024 * 1024)]), proc.stderr
        assert os.listdir(small_disk) == []  # nothing published, no hidden partial output left


def test_enospc_from_the_shard_writer_is_one_line(tmp_path, capsys, monkeypatch):
    from foundrymix.format import mds

    def full_disk(path, *args, **kwargs):
        if os.path.basename(path) == 'shard.00001.mds':
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return open(path, *args, **kwargs)

    monkeypatch.setattr(mds, 'open', full_disk, raising=False)  # the module's own name, not the builtin
    out = tmp_path / 'out'
    rc = main(['convert', 'pretrain', str(SAMPLES / 'arxiv_sample.jsonl'), '-o', str(out), '--max-seq-len', str(L),
               '--no-progress', '--workers', '1', '--size-limit', '64kb'])
    lines = capsys.readouterr().err.splitlines()
    # the free bytes of this (shared) disk move; the rest of the line is exact
    assert rc == 2 and len(lines) == 1 and re.sub(r'\(\d[\d,]* bytes free', '(0 bytes free', lines[0]) == \
        line(str(out), 0), lines
    assert os.listdir(tmp_path) == []

"""An iterator left open when the interpreter exits: nothing printed (its prefetch threads were
stopped in the teardown, where ``queue`` is gone: ``AttributeError: ... no attribute 'Empty'``).
A real ``python`` process that takes one batch and exits, with and without DataLoader workers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from helpers import ROOT, staged


@pytest.mark.parametrize('workers', [0, 2])
def test_an_iterator_left_open_at_exit_prints_nothing(small_streams, tmp_path, workers):
    config = staged(small_streams)
    config['train_loader']['num_workers'] = workers
    (tmp_path / 'data.yaml').write_text(yaml.safe_dump(config), encoding='utf-8')
    script = ('import sys, foundrymix\n'
              'batches = iter(foundrymix.build_loader(sys.argv[1], rank=0, world_size=1))\n'
              'print(len(next(batches)["input_ids"]))\n')
    proc = subprocess.run([sys.executable, '-c', script, str(tmp_path / 'data.yaml')], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, '4\n', '')

"""Thousands of local streams within a default ``ulimit -n 1024`` (issue 55): a run claims every
stream directory it reads, and once held one claim file open per directory, so 2,000 streams
died at start with ``OSError: [Errno 24] Too many open files``. Real ``train.py`` processes under
``RLIMIT_NOFILE = 1024`` build the run over 2,000 (and 200) stream directories -- each its own
directory of the paper's real shards, hard links, so claims see 2,000 paths -- train a batch,
and count their open descriptors while the claims are held: the same for 200 and 2,000.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, tiny_run_config

ENV = {**os.environ, 'PYTHONPATH': str(ROOT), 'HF_HUB_OFFLINE': '1', 'TRANSFORMERS_OFFLINE': '1',
       'TOKENIZERS_PARALLELISM': 'false'}

#: builds the run, trains, and reports its open descriptors while it holds its claims
SCRIPT = """
import json, os, sys
from foundrymix.train.builder import build_trainer
from foundrymix.train.config import load_config
run = build_trainer(load_config(sys.argv[1], []))
built = len(os.listdir('/proc/self/fd'))
run.trainer.fit()
trained = len(os.listdir('/proc/self/fd'))
claims = sorted(os.readlink(f'/proc/self/fd/{fd}') for fd in os.listdir('/proc/self/fd')
                if os.path.exists(f'/proc/self/fd/{fd}') and 'foundrymix-claims' in os.readlink(f'/proc/self/fd/{fd}'))
print(json.dumps({'built': built, 'trained': trained, 'claim_files': claims,
                  'batch': run.trainer.state.timestamp.batch.value, 'held': len(run.claims.held)}))
run.trainer.close()
run.claims.release()
"""


def streams(src: Path, root: Path, n: int) -> dict[str, str]:
    """``n`` stream directories holding ``src``'s files (hard links: distinct directories, no copies)."""
    out = {}
    for k in range(n):
        d = root / f's{k:04d}'
        d.mkdir(parents=True)
        for f in src.iterdir():
            os.link(f, d / f.name)
        out[f's{k:04d}'] = str(d)
    return out


def limit_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


def run_with(tmp_path: Path, src: Path, n: int) -> dict:
    data = streams(src, tmp_path / f'd{n}', n)
    loader = {'streams': {name: {'local': d} for name, d in data.items()}, 'num_workers': 0}
    cfg = tiny_run_config(loader, global_train_batch_size=4, max_duration='2ba')
    path = tmp_path / f'run{n}.yaml'
    path.write_text(yaml.safe_dump(cfg), encoding='utf-8')
    (tmp_path / 'script.py').write_text(SCRIPT, encoding='utf-8')
    proc = subprocess.run([sys.executable, str(tmp_path / 'script.py'), str(path)], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=900, preexec_fn=limit_files)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two train.py-like processes over 200 and 2,000 streams (about 1 min each on a quiet machine)
@pytest.mark.timeout(1500)
def test_two_thousand_streams_train_under_ulimit_1024_holding_no_descriptor_per_stream(tmp_path, small_streams):
    few = run_with(tmp_path, small_streams['arxiv'], 200)
    many = run_with(tmp_path, small_streams['arxiv'], 2000)
    assert (few['batch'], many['batch']) == (2, 2)
    assert (few['held'], many['held']) == (200, 2000)  # every directory claimed
    assert len(many['claim_files']) == 1 and many['claim_files'][0].endswith('.run')
    for when in ('built', 'trained'):
        assert abs(many[when] - few[when]) < 10, (few, many)
    assert many['trained'] < 200

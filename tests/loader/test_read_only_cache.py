"""A cache this user may not write is named as the cache -- its directory and the permission --
not reported as a remote that cannot be read (issue 55). The real ``foundrymix plan`` command
line over a remote stream on a real S3 endpoint (moto on 127.0.0.1), obeying file modes (as
root: under ``setpriv`` without root's file-access capabilities): a read-only ``cache_root``,
and a stream's cache directory filled by an earlier run and then made read-only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, mode_prefix, moto_s3, tiny_run_config

BUCKET = 'fmx-ro-cache'


@pytest.fixture(scope='module')
def s3():
    with moto_s3(BUCKET) as server:
        yield server


def plan(config: Path, env: dict, prefix: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, '-m', 'foundrymix.cli', 'plan', str(config)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, **env, 'PYTHONPATH': str(ROOT), 'HF_HUB_OFFLINE': '1'})


def test_a_read_only_cache_is_named_with_its_permission_not_as_the_remote(tmp_path, s3, small_streams):
    prefix = mode_prefix()
    if prefix is None:
        pytest.skip('root without setpriv: file modes are not enforced')
    for f in sorted(small_streams['arxiv'].iterdir()):
        s3['client'].upload_file(str(f), BUCKET, f'arxiv/{f.name}')
    cache = tmp_path / 'cache'
    cache.mkdir()
    config = tmp_path / 'run.yaml'
    loader = {'streams': {'ds': {'remote': f's3://{BUCKET}/arxiv'}}, 'cache_root': str(cache)}
    config.write_text(yaml.safe_dump(tiny_run_config(loader, global_train_batch_size=4, max_duration='2ba')))

    cache.chmod(0o555)  # nothing cached yet: the stream's directory cannot be made
    try:
        empty = plan(config, s3['env'], prefix)
    finally:
        cache.chmod(0o755)
    assert os.listdir(cache) == []
    assert plan(config, s3['env'], []).returncode == 0  # writable: the metadata is cached
    filled = [Path(d) for d, _, files in os.walk(cache) if 'index.json' in files]
    assert len(filled) == 1
    filled[0].chmod(0o555)  # an earlier run's directory, now read-only
    try:
        again = plan(config, s3['env'], prefix)
    finally:
        filled[0].chmod(0o755)

    for r, where in ((empty, cache), (again, filled[0])):
        assert r.returncode == 2, r.stderr
        line = r.stderr.strip()
        assert '\n' not in line and 'Traceback' not in line, r.stderr
        assert line.startswith('foundrymix plan: error: cache directory '), line
        assert f'permission denied writing {where}' in line, line
        assert 'cannot read' not in line and 'the remote was not the problem' in line

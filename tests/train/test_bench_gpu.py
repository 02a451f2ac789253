"""``benchmarks/bench_gpu.py --device cpu --tiny``: the GPU benchmark's CI run (on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT


@pytest.mark.slow  # a tiny training in a subprocess
def test_bench_gpu_runs_on_cpu_tiny(tmp_path):
    out = tmp_path / 'bench.json'
    proc = subprocess.run([sys.executable, str(ROOT / 'benchmarks' / 'bench_gpu.py'), '--device', 'cpu', '--tiny',
                           '--repeats', '2', '--peak-flops', '1e9', '--json', str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert (got['device'], got['world_size'], got['seq']) == ('cpu', 1, 64)
    rows = {r['row']: r for r in got['results']}
    assert list(rows) == ['tiny/sdpa/eager/full/none/4', 'tiny/flex/eager/fused/none/4',
                          'tiny/sdpa/eager/full/FULL_SHARD/4', 'tiny/flash/eager/full/none/4',
                          'tiny/sdpa/eager/full/none/4/fp8']
    assert [r['status'] for r in got['results'][2:]] == [
        'skipped: FSDP needs CUDA', 'skipped: flash_attention_2 needs CUDA', 'skipped: amp_fp8 needs a GPU with FP8']
    assert {(r['device'], r['model'], r['batch']) for r in got['results']} == {('cpu', 'tiny', 4)}  # each row says
    # the finetune stream is the real converter's packing of the bundled Dolly sample
    assert 'bench_gpu: finetune stream: ' in proc.stderr and ' x 1,000 Dolly examples, ' in proc.stderr
    plain, fast = rows['tiny/sdpa/eager/full/none/4'], rows['tiny/flex/eager/fused/none/4']
    for ran in (plain, fast):
        assert ran['status'] == 'ok' and (ran['steps'], ran['batches'], ran['batch']) == (4, 5, 4)  # 1 warmup step
        assert ran['real_tokens'] == ran['accounting_tokens'] > 0  # every batch timed, counted once
        # (real tokens <= positions: equal when the timed batches hold only full pretrain rows)
        assert 0 < ran['loader_share'] < 1 and ran['positions_per_s'] >= ran['real_tokens_per_s'] > 0
        assert ran['peak_mem_gb'] is None  # no CUDA memory on a CPU
        # Foundry's 6N + 12 L d S (L 2, d 32, S 64) per position, and per real token
        flops = 6 * ran['params'] + 12 * 2 * 32 * 64
        assert ran['mfu'] == pytest.approx(flops * ran['positions_per_s'] / 1e9)
        assert ran['mfu_real'] == pytest.approx(flops * ran['real_tokens_per_s'] / 1e9)
        # two runs, the median one (of two: the slower) reported with the spread of both
        runs = ran['runs_positions_per_s']
        assert len(runs) == 2 and round(ran['positions_per_s'], 1) == min(runs)
        assert ran['spread'] == pytest.approx((max(runs) - min(runs)) / ((runs[0] + runs[1]) / 2))
        # per measured step: the DataLoader's __next__ lies inside the wait; the accounting's count
        # (at after_train_batch, after the wait) is timed once per step
        assert len(ran['waits_ms']) == len(ran['nexts_ms']) == len(ran['counts_ms']) == 4
        assert all(n <= w for w, n in zip(ran['waits_ms'], ran['nexts_ms']))
        assert all(c > 0 for c in ran['counts_ms'])
        assert ran['next_ms'] > 0 and ran['count_ms'] > 0 and ran['next_max_ms'] >= ran['next_ms']
        assert ran['batch_bytes'] == 5 * 4 * 64 * 8 + 2 * 4 * 8  # five (4, 64) int64 tensors, two (4,)
    # the fast path trains the same rows: the same counts per stream
    assert fast['stream_samples'] == plain['stream_samples'] and sum(plain['stream_samples'].values()) == 20
    # N of 6N + 12LdS: 2 layers of (4 d^2 + 3 d i) plus the output layer, d 32, i 64, vocab 8192
    assert plain['params'] == 2 * (4 * 32 * 32 + 3 * 32 * 64) + 8192 * 32
    assert 'tiny   ' in proc.stdout and 'skipped: FSDP needs CUDA' in proc.stdout

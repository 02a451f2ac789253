"""CUDA runs of the second GPU round (skipped without CUDA; ``benchmarks/gpu_round2.sh`` runs them).

* (FSDP2's stop/resume and export: ``test_gpu_runs.py``, beside FSDP1's.)
* FSDP2 with the fused loss and ``torch.compile`` counts exactly what the single-GPU fused run
  counts, its per-stream losses within bf16's precision of it.
* ``precision: amp_fp8`` (torchao's float8 linears, capability >= 8.9): over 300 steps on the same
  rows its per-stream loss curve stays within 5 % of ``amp_bf16``'s at every logged point.
"""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL_SEQ
from train_helpers import fit_in_process as fit

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU'), pytest.mark.slow]
FSDP2 = {'version': 2}
#: linear sizes FP8 matmuls take (multiples of 16); head dim 16
MODEL16 = {'type': 'llama', 'hidden_size': 64, 'intermediate_size': 128, 'num_hidden_layers': 2,
           'num_attention_heads': 4, 'num_key_value_heads': 4, 'max_position_embeddings': SMALL_SEQ}


def losses(report: dict) -> dict[tuple[int, int], float]:
    """Each logged interval's mean loss per stream (from the history's running sums), by (batch, stream)."""
    out, before_sum, before_targets = {}, None, None
    for point in report['history']:
        sums, targets = point['loss_sum'], point['loss_targets']
        for i, (s, t) in enumerate(zip(sums, targets)):
            done = t - (before_targets[i] if before_targets else 0)
            if done:
                out[(point['batch'], i)] = (s - (before_sum[i] if before_sum else 0)) / done
        before_sum, before_targets = sums, targets
    return out


def counts(report: dict) -> list:
    """The history without its losses (the counters of every logged point)."""
    return [{k: v for k, v in p.items() if k not in ('loss_sum', 'loss_targets')} for p in report['history']]


def test_fsdp2_with_fused_loss_and_compile_counts_what_one_gpu_counts(small_streams, tmp_path, process_group_ends):
    model = {**MODEL16, 'fused_loss': True}
    sharded = fit(small_streams, tmp_path / 'fsdp2', model=model, fsdp=FSDP2, compile_config={},
                  precision='amp_bf16')
    plain = fit(small_streams, tmp_path / 'plain', model=model, compile_config={}, precision='amp_bf16')
    assert counts(sharded) == counts(plain) and sum(counts(plain)[-1]['samples']) == 8 * 4
    got, want = losses(sharded), losses(plain)
    assert got.keys() == want.keys() and got
    for where, value in want.items():
        assert got[where] == pytest.approx(value, rel=2e-2), where


def test_fp8_loss_curve_stays_within_5_percent_of_bf16(small_streams, tmp_path):
    pytest.importorskip('torchao.float8')
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip('FP8 needs CUDA capability >= 8.9')
    bf16 = fit(small_streams, tmp_path / 'bf16', batches=300, log='25ba', model=MODEL16, precision='amp_bf16',
               optimizer={'lr': 3e-3})
    fp8 = fit(small_streams, tmp_path / 'fp8', batches=300, log='25ba', model=MODEL16, precision='amp_fp8',
              optimizer={'lr': 3e-3})
    got, want = losses(fp8), losses(bf16)
    assert got.keys() == want.keys() and len(got) >= 12
    first, last = min(b for b, _ in want), max(b for b, _ in want)
    assert all(want[(last, s)] < want[(first, s)] for _, s in want if (last, s) in want)  # it learned
    for where, value in want.items():
        assert got[where] == pytest.approx(value, rel=5e-2), where

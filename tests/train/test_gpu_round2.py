"""CUDA runs of the second GPU round (skipped without CUDA; ``benchmarks/gpu_round2.sh`` runs them).

* FSDP2 (``fsdp.version: 2``, ``fully_shard`` on one GPU): a run stopped at a checkpoint and resumed
  ends with the weights, counters and sample log of the straight run, bitwise (as FSDP1's test);
  ``foundrymix export --to-hf`` of its checkpoint holds those weights.
* FSDP2 with the fused loss and ``torch.compile`` counts exactly what the single-GPU fused run
  counts, its per-stream losses within bf16's precision of it.
* ``precision: amp_fp8`` (torchao's float8 linears, capability >= 8.9): over 300 steps on the same
  rows its per-stream loss curve stays within 5 % of ``amp_bf16``'s at every logged point.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import SMALL_SEQ, tiny_run_config

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU'), pytest.mark.slow]
FSDP2 = {'version': 2}
#: linear sizes FP8 matmuls take (multiples of 16); head dim 16
MODEL16 = {'type': 'llama', 'hidden_size': 64, 'intermediate_size': 128, 'num_hidden_layers': 2,
           'num_attention_heads': 4, 'num_key_value_heads': 4, 'max_position_embeddings': SMALL_SEQ}


def fit(streams: dict, d: Path, batches: int = 8, stop: str | None = None, log: str = '3ba', device: str = 'gpu',
        **top) -> dict:
    """``batches`` batches of 4 (checkpoints every 2); returns the stream report."""
    from foundrymix.train.builder import build_trainer
    from foundrymix.train.config import TrainConfig

    loader = {'streams': {n: {'local': str(p)} for n, p in streams.items()}, 'num_workers': 0}
    callbacks = {'stream_accounting': {'out_dir': str(d / 'report'), 'log_interval': log, 'plot': False},
                 'sample_log': {'path': str(d / 's.jsonl'), 'interval': '3ba'}}
    if stop:
        callbacks['stop_at'] = {'time': stop}
    run = build_trainer(TrainConfig.from_dict(tiny_run_config(
        loader, global_train_batch_size=4, max_duration=f'{batches}ba', device=device, save_folder=str(d / 'ckpt'),
        save_interval='2ba', callbacks=callbacks, **top)))
    try:
        run.trainer.fit()
    finally:
        run.trainer.close()
        run.claims.release()
    return json.loads((d / 'report' / 'stream_accounting.json').read_text())


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location='cpu', weights_only=False)['state']['model']


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


def test_fsdp2_stop_resume_is_bitwise_and_exports(small_streams, tmp_path, process_group_ends):
    from safetensors.torch import load_file

    from foundrymix.cli import main as cli

    straight = fit(small_streams, tmp_path / 'straight', fsdp=FSDP2, precision='amp_bf16')
    stopped = tmp_path / 'stopped'
    fit(small_streams, stopped, fsdp=FSDP2, precision='amp_bf16', stop='4ba')
    resumed = fit(small_streams, stopped, fsdp=FSDP2, precision='amp_bf16',
                  load_path=str(stopped / 'ckpt' / 'ep0-ba4-rank0.pt'))
    a, b = weights(tmp_path / 'straight' / 'ckpt' / 'latest-rank0.pt'), weights(stopped / 'ckpt' / 'latest-rank0.pt')
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (resumed['streams'], resumed['history']) == (straight['streams'], straight['history'])
    assert (stopped / 's.jsonl').read_text() == (tmp_path / 'straight' / 's.jsonl').read_text()
    assert cli(['export', str(stopped / 'ckpt' / 'latest-rank0.pt'), '--to-hf', str(tmp_path / 'hf')]) == 0
    exported = {}
    for f in sorted((tmp_path / 'hf').glob('*.safetensors')):
        exported.update(load_file(f))
    assert exported
    for name, tensor in exported.items():
        assert torch.equal(tensor, a[f'model.{name}'].to(tensor.dtype)), name


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

"""Training runs on a CUDA GPU (skipped without one; ``scripts/gpu_check.sh`` runs them).

* FSDP (``FULL_SHARD`` on one GPU, ``state_dict_type: full``) and FSDP2 (``fsdp.version: 2``,
  ``fully_shard``): a run stopped at a checkpoint
  and resumed ends with the weights, counters and sample log of the straight run, bitwise;
  ``foundrymix export --to-hf`` of its checkpoint holds those weights.
* ``amp_bf16`` on the GPU counts exactly what the CPU run of the same config counts.
* Two ranks on GPUs (NCCL): needs two GPUs -- NCCL refuses two ranks on one device
  ("Duplicate GPU detected"), so with one GPU the 2-rank runs are the gloo CPU runs of
  ``tests/train/test_distributed.py``. This is the run a CPU-tensor collective fails at batch 1.
"""

from __future__ import annotations


import pytest
import torch
from train_helpers import checkpoint_weights as weights
from train_helpers import fit_in_process as fit

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason='needs 2 GPUs (NCCL refuses two ranks on one GPU)')
pytestmark = [gpu, pytest.mark.slow]
FSDP = {'sharding_strategy': 'FULL_SHARD', 'state_dict_type': 'full'}
FSDP2 = {'version': 2}  # fully_shard


def split_loss(report: object, path: str = '') -> tuple[object, dict[str, float]]:
    """The report without its float losses (``loss``, history's ``loss_sum``), and those by their place."""
    if isinstance(report, dict):
        kept, losses = {}, {}
        for k, v in report.items():
            if k in ('loss', 'loss_sum'):
                losses[f'{path}/{k}'] = v
                continue
            kept[k], inner = split_loss(v, f'{path}/{k}')
            losses.update(inner)
        return kept, losses
    if isinstance(report, list):
        pairs = [split_loss(v, f'{path}/{i}') for i, v in enumerate(report)]
        return [p[0] for p in pairs], {k: v for p in pairs for k, v in p[1].items()}
    return report, {}


def test_bf16_gpu_counts_equal_the_cpu_run(small_streams, tmp_path):
    """Counts equal exactly; the per-stream loss (bf16 autocast vs fp32) only within bf16's precision."""
    on_gpu = fit(small_streams, tmp_path / 'gpu', precision='amp_bf16')
    on_cpu = fit(small_streams, tmp_path / 'cpu', device='cpu', precision='fp32')
    (gpu_counts, gpu_loss), (cpu_counts, cpu_loss) = (
        split_loss([r['streams'], r['total'], r['history']]) for r in (on_gpu, on_cpu))
    assert gpu_counts == cpu_counts
    assert gpu_loss.keys() == cpu_loss.keys() and gpu_loss
    for where, value in cpu_loss.items():
        assert gpu_loss[where] == pytest.approx(value, rel=2e-2), where
    assert (tmp_path / 'gpu' / 's.jsonl').read_text() == (tmp_path / 'cpu' / 's.jsonl').read_text()


@two_gpus
def test_two_gpu_ranks_count_what_one_rank_counts(small_streams, tmp_path):
    from distributed_helpers import report, train_1rank, train_nranks, write_config
    from train_helpers import sample_log

    data = {name: str(path) for name, path in small_streams.items()}
    one = tmp_path / 'one'
    one.mkdir()
    train_1rank(write_config(one, data, log_interval='4ba', device='gpu', max_duration='10ba'))
    two = tmp_path / 'two'
    two.mkdir()  # composer -n 2: one GPU per rank
    train_nranks(write_config(two, data, log_interval='4ba', device='gpu', max_duration='10ba'))
    assert report(two)['history'] == report(one)['history']
    assert report(two)['streams'] == report(one)['streams']
    assert [sorted(b['sample_ids']) for b in sample_log(two / 'samples.jsonl')] == [
        sorted(b['sample_ids']) for b in sample_log(one / 'samples.jsonl')]


@pytest.mark.parametrize('fsdp', [FSDP, FSDP2], ids=['fsdp1', 'fsdp2'])
def test_fsdp_stop_resume_is_bitwise_and_exports(small_streams, tmp_path, process_group_ends, fsdp):
    from safetensors.torch import load_file

    from foundrymix.cli import main as cli

    straight = fit(small_streams, tmp_path / 'straight', fsdp=fsdp, precision='amp_bf16')
    stopped = tmp_path / 'stopped'
    fit(small_streams, stopped, fsdp=fsdp, precision='amp_bf16', stop='4ba')
    resumed = fit(small_streams, stopped, fsdp=fsdp, precision='amp_bf16',
                  load_path=str(stopped / 'ckpt' / 'ep0-ba4-rank0.pt'))
    a, b = weights(tmp_path / 'straight' / 'ckpt' / 'latest-rank0.pt'), weights(stopped / 'ckpt' / 'latest-rank0.pt')
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (resumed['streams'], resumed['history']) == (straight['streams'], straight['history'])
    assert (stopped / 's.jsonl').read_text() == (tmp_path / 'straight' / 's.jsonl').read_text()

    assert cli(['export', str(stopped / 'ckpt' / 'latest-rank0.pt'), '--to-hf', str(tmp_path / 'hf')]) == 0
    exported = {}
    for f in sorted((tmp_path / 'hf').glob('*.safetensors')):
        exported.update(load_file(f))
    assert exported, 'no safetensors written'
    for name, tensor in exported.items():  # CausalLM holds the HF model as `model`
        assert torch.equal(tensor, a[f'model.{name}'].to(tensor.dtype)), name

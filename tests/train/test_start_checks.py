"""What Composer refuses at the start of a run is refused first, by ``plan`` and ``train`` alike.

Each config below passed ``foundrymix plan`` and then died in ``train`` with a Composer
traceback that named no key. Both commands now stop with the same one line (exit 2,
no traceback), through the real command line; where the line gives a value, that value
is checked to pass. These tests assume a machine without a GPU (the CPU suite).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from helpers import ROOT, SMALL_SEQ, tiny_run_config

from foundrymix.config import ConfigError

pytestmark = pytest.mark.skipif(
    __import__('torch').cuda.is_available(), reason='the refusals are of a CPU run')

WHERE = 'the CPU (device: auto, and this machine has no GPU)'

CASES = [
    (['device_train_microbatch_size=auto'],
     f"device_train_microbatch_size: auto needs a GPU (Composer fits the microbatch to the GPU's "
     f"memory), and this run is on {WHERE}: leave it out (one microbatch per batch) or give a whole "
     f"number that divides the per-rank batch"),
    (['max_duration=2048tok', 'scheduler.t_warmup=2ba'],
     "scheduler.t_warmup: 2ba is in batches, but this run is counted in tokens (max_duration 2048tok) "
     "and Composer's cosine_with_warmup takes t_warmup in that unit: give t_warmup: 1024tok (the same "
     "point) or a fraction of the run (e.g. 0.05dur)"),
    (['precision=amp_bf16'],
     f'precision: amp_bf16 needs a GPU, and this run is on {WHERE}: give precision: fp32 (or auto: '
     f'fp32 on CPU, amp_bf16 on GPU)'),
    (['precision=amp_fp8'],
     f'precision: amp_fp8 needs a GPU, and this run is on {WHERE}: give precision: fp32 (or auto: '
     f'fp32 on CPU, amp_bf16 on GPU)'),
    (['load_path=oci://my-bucket/checkpoints/ep0-ba100-rank0.pt'],
     'load_path: oci://my-bucket/checkpoints/ep0-ba100-rank0.pt: foundrymix loads checkpoints from a '
     'local path or s3://bucket/key, not oci://; give one of those, or leave load_path out to start '
     'from scratch'),
    (['fsdp={sharding_strategy: FULL_SHARD}'],
     f'fsdp: FSDP runs on GPUs, and this run is on {WHERE}: leave fsdp out'),
]


@pytest.fixture
def run_yaml(small_streams, tmp_path):
    cfg = tiny_run_config({'streams': {'arxiv': {'local': str(small_streams['arxiv'])},
                                       'dolly': {'local': str(small_streams['dolly'])}},
                           'num_workers': 0},
                          global_train_batch_size=4, max_duration='6ba', run_name='start-checks',
                          save_folder=str(tmp_path / 'ckpt'),
                          callbacks={'stream_accounting': {'out_dir': str(tmp_path / 'report')}})
    path = tmp_path / 'run.yaml'
    path.write_text(yaml.safe_dump(cfg))
    return path


def cli(*argv: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.mark.parametrize('overrides, line', CASES, ids=['microbatch-auto', 'warmup-unit', 'amp-bf16', 'amp-fp8',
                                                          'oci-load-path', 'fsdp'])
def test_plan_and_train_refuse_what_composer_would_in_one_line(run_yaml, tmp_path, overrides, line):
    """The same line from ``foundrymix plan`` and ``python train.py``; nothing written."""
    for command, argv in (('plan', ['-m', 'foundrymix.cli', 'plan']), ('train', [str(ROOT / 'train.py')])):
        proc = cli(*argv, str(run_yaml), *overrides, cwd=tmp_path)
        assert (proc.returncode, proc.stderr.splitlines()[-1:]) == (2, [f'foundrymix {command}: error: {line}']), \
            proc.stderr
        assert 'Traceback' not in proc.stderr and proc.stdout == ''
    assert sorted(p.name for p in tmp_path.iterdir()) == ['run.yaml']  # no checkpoint, report or run dir


@pytest.mark.slow  # two train.py runs
def test_a_checkpoint_of_another_model_is_one_line(run_yaml, tmp_path):
    """``load_path`` of a checkpoint whose tensors have other shapes: one line naming it and the first
    mismatch (torch's words), not Composer's traceback."""
    first = cli(str(ROOT / 'train.py'), str(run_yaml), 'max_duration=1ba', 'save_interval=1ba', cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = tmp_path / 'ckpt' / 'ep0-ba1-rank0.pt'
    proc = cli(str(ROOT / 'train.py'), str(run_yaml), 'model.intermediate_size=96', f'load_path={ckpt}',
               f'save_folder={tmp_path / "other"}', cwd=tmp_path)
    assert proc.returncode == 2 and 'Traceback' not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.splitlines()[-1]
    assert line.startswith(f'foundrymix train: error: {ckpt}: the checkpoint is of another model (size mismatch '
                           f'for '), line
    assert 'torch.Size([64, 32])' in line and 'torch.Size([96, 32])' in line, line
    assert line.endswith('give the model section it was trained with, or another checkpoint'), line
    assert not (tmp_path / 'other').exists()


def test_device_gpu_without_cuda_is_refused_by_train_in_one_line(run_yaml, tmp_path):
    """``train`` refuses it (``plan`` plans a GPU run on any machine); nothing written."""
    proc = cli(str(ROOT / 'train.py'), str(run_yaml), 'device=gpu', cwd=tmp_path)
    assert (proc.returncode, proc.stderr.splitlines()[-1:]) == (2, [
        'foundrymix train: error: device: gpu, and this machine has no CUDA GPU that torch can use '
        '(torch.cuda.is_available() is false): give device: cpu, or auto']), proc.stderr
    assert 'Traceback' not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ['run.yaml']


@pytest.mark.skipif(int(__import__('transformers').__version__.split('.')[0]) < 5,
                    reason='transformers 4.x builds such a config')
def test_a_model_transformers_refuses_is_one_line(run_yaml, tmp_path):
    """transformers 5 validates the config as it is built: its reason, in one line; nothing written."""
    proc = cli(str(ROOT / 'train.py'), str(run_yaml), 'model.hidden_size=33', cwd=tmp_path)
    assert (proc.returncode, proc.stderr.splitlines()[-1:]) == (2, [
        'foundrymix train: error: model: The hidden size (33) is not a multiple of the number of attention '
        'heads (2).']), proc.stderr
    assert 'Traceback' not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ['run.yaml']


@pytest.mark.slow
def test_the_warmup_the_refusal_names_plans_and_a_zero_warmup_trains_in_tokens(run_yaml, tmp_path):
    """``t_warmup: 1024tok`` (the line's value) plans; the default ``0ba`` warmup, which Composer
    refused next to a ``tok`` max_duration, is the same point in tokens: the run trains to the end."""
    from foundrymix.cli import main
    assert main(['plan', str(run_yaml), 'max_duration=2048tok', 'scheduler.t_warmup=1024tok']) == 0
    proc = cli(str(ROOT / 'train.py'), str(run_yaml), 'max_duration=2048tok', cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / 'report' / 'stream_accounting.json').read_text())
    # 2048 tokens in Composer's count (rows x SMALL_SEQ), 4 rows a batch: 4 batches, 16 rows
    assert (summary['batch'], summary['total']['samples']) == (2048 // SMALL_SEQ // 4, 16), summary


@pytest.mark.slow
def test_relaunching_a_finished_run_with_autoresume_says_it_is_finished(run_yaml, tmp_path):
    """A scheduler relaunching a finished run: exit 0 and one line (the checkpoint and its batch),
    no Composer ``max_duration ... less than or equal to the elapsed training duration`` traceback,
    and the checkpoints untouched. The line's advice works: a longer max_duration trains on."""
    ckpt = tmp_path / 'ckpt'
    argv = [str(ROOT / 'train.py'), str(run_yaml), 'autoresume=true', 'save_interval=3ba']
    first = cli(*argv, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    assert sorted(before) == ['ep0-ba3-rank0.pt', 'ep0-ba6-rank0.pt', 'latest-rank0.pt']
    again = cli(*argv, cwd=tmp_path)
    assert again.returncode == 0 and 'Traceback' not in again.stderr, again.stderr
    assert again.stdout.splitlines() == [
        f'already finished: {ckpt / "latest-rank0.pt"} is at batch 6, the end of max_duration 6ba; '
        f'nothing to train (to train on, raise max_duration)']
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    longer = cli(*argv, 'max_duration=9ba', cwd=tmp_path)
    assert longer.returncode == 0, longer.stderr
    assert f'resumed from {ckpt / "latest-rank0.pt"} at batch 6' in longer.stdout
    assert 'ep0-ba9-rank0.pt' in {p.name for p in ckpt.iterdir()}


def test_on_a_gpu_the_gpu_settings_pass_and_device_cpu_is_named(run_yaml):
    """The same check with the device it is given: on a GPU (as ``device: auto`` finds one) the
    three GPU settings pass; ``device: cpu`` set in the YAML is named as such, on any machine; an
    unknown precision is refused everywhere."""
    from foundrymix.config import ConfigErrors
    from foundrymix.plan.stages import Topology, plan_run
    from foundrymix.train.config import load_config
    from foundrymix.train.preflight import check_start

    gpu = ['device_train_microbatch_size=auto', 'precision=amp_bf16', 'fsdp={sharding_strategy: FULL_SHARD}']
    cfg = load_config(str(run_yaml), gpu)
    run, _ = plan_run(cfg.train_loader, 4, cfg.max_duration, Topology(nodes=1, ranks_per_node=1))
    assert check_start(cfg, run, device=lambda: 'gpu') == ('6ba', '0ba')
    with pytest.raises(ConfigErrors) as err:
        check_start(load_config(str(run_yaml), [*gpu, 'device=cpu']), run, device=lambda: 'gpu')
    assert [str(e).split(', and this run is on ')[1].split(':')[0] for e in err.value.errors] == ['device'] * 3
    assert [e.path for e in err.value.errors] == ['device_train_microbatch_size', 'fsdp', 'precision']
    with pytest.raises(ConfigError, match=r"^precision: 'bf16' is not one of auto, fp32, amp_fp16, amp_bf16, "
                                          r"amp_fp8 \(auto: fp32 on CPU, amp_bf16 on GPU\)$"):
        check_start(load_config(str(run_yaml), ['precision=bf16']), run, device=lambda: 'gpu')


def test_flex_attention_on_a_cpu_without_its_backward_is_refused_at_start(run_yaml, monkeypatch):
    """torch 2.11's FlexAttention has no CPU backward: it raises at the first training forward,
    mid-fit. Given such a torch (the probe answering no), a CPU run is refused at start naming the
    key and the fix; a GPU run passes; with the probe answering yes the CPU run passes."""
    from foundrymix.plan.stages import Topology, plan_run
    from foundrymix.train import flex
    from foundrymix.train.config import load_config
    from foundrymix.train.preflight import check_start

    cfg = load_config(str(run_yaml), ['model.attn_implementation=flex_attention'])
    run, _ = plan_run(cfg.train_loader, 4, cfg.max_duration, Topology(nodes=1, ranks_per_node=1))
    monkeypatch.setattr(flex, 'trains_on_cpu', lambda: True)
    assert check_start(cfg, run, device=lambda: 'cpu') == ('6ba', '0ba')
    monkeypatch.setattr(flex, 'trains_on_cpu', lambda: False)
    assert check_start(cfg, run, device=lambda: 'gpu') == ('6ba', '0ba')
    with pytest.raises(ConfigError) as err:
        check_start(cfg, run, device=lambda: 'cpu')
    assert str(err.value) == (
        f'model.attn_implementation: flex_attention has no backward on the CPU in torch '
        f'{__import__("torch").__version__}, and this run is on {WHERE}: give attn_implementation: sdpa '
        f'for a CPU run (flex_attention on a GPU)')

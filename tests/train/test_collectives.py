"""Every collective foundrymix makes: on the trainer's device, and only where a sum is read.

Why: Composer starts a plain ``nccl`` process group on GPUs, which takes CUDA tensors only,
so a collective on a CPU tensor fails a multi-rank GPU run at its first batch; and a
collective per batch is a sync per batch where one per log interval does. The audit runs a
real tiny training in-process and *observes* Composer's collectives (``composer.utils.dist``,
the only route foundrymix has to ``torch.distributed``, checked first) from foundrymix code:
which hook made them, at which batch, and the device of every tensor. The ``gpu`` variant
(skipped without CUDA) is the same run on ``device: gpu``.

The collectives (Composer 0.32): ``StreamAccounting.reduce`` (``all_reduce``, at
``log_interval``, checkpoint save, fit end), ``SampleLog.flush`` (``all_gather_object``, at
its ``interval``, checkpoint save, fit end), ``S3Log`` (``all_gather_object``, at epoch end
and fit end). ``builder``/``cli`` only read ranks and world sizes. ``ResumeRng.state_dict``
gathers the ranks' RNG states at each checkpoint save through Composer's
``reproducibility.get_rng_state`` (an ``all_gather_object`` made from Composer's frame, as
Composer's own save makes it at the same point), so the audit does not list it. One
collective per batch is made on purpose, outside Composer: on more than one rank the
loader's ``StopTogether`` sums one CPU integer over its own gloo group before each batch,
so a rank whose read failed stops every rank there (the premise test checks its group).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, tiny_run_config

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
COLLECTIVES = ('all_reduce', 'all_gather', 'all_gather_object', 'broadcast', 'broadcast_object_list', 'barrier')


#: the one module that reaches torch.distributed itself (the loader imports no Composer)
AGREEMENT = 'foundrymix/train/together.py'


def test_foundrymix_reaches_torch_distributed_only_through_composer_dist():
    """The premise of the audit below: patching ``composer.utils.dist`` sees every collective
    -- but the ranks' agreement before each batch (:data:`AGREEMENT`), whose every collective
    is on the gloo group it makes (CPU tensors, never Composer's NCCL group on GPUs); that it
    stops every rank is tested in ``tests/loader/test_stop_together.py`` and
    ``test_distributed.py``, what it costs in ``benchmarks/bench_together.py``."""
    direct = []
    for path in sorted((ROOT / 'foundrymix').rglob('*.py')):
        for n, line in enumerate(path.read_text(encoding='utf-8').splitlines(), 1):
            if re.search(r'torch\.distributed|from torch import distributed', line):
                direct.append(f'{path.relative_to(ROOT)}:{n}')
    assert {d.split(':')[0] for d in direct} == {AGREEMENT}
    source = (ROOT / AGREEMENT).read_text(encoding='utf-8')
    calls = re.findall(r'tdist\.(\w+)\(([^)]*)\)', source)
    assert {name for name, _ in calls if name in COLLECTIVES} == {'all_reduce', 'all_gather_object'}
    assert all('group=self._group' in args for name, args in calls if name in COLLECTIVES)
    assert "self._group = tdist.new_group(backend='gloo')" in source


class CollectiveLog:
    """Wraps ``composer.utils.dist``'s collectives; keeps the calls made from foundrymix code."""

    def __init__(self, monkeypatch, state_of) -> None:
        from composer.utils import dist
        self.calls: list[tuple[str, str, str, int, list[torch.device]]] = []
        self.tensors: list[torch.Tensor] = []  # every tensor a collective got
        self.moved: list[torch.Tensor] = []    # every tensor the trainer's device returned
        self.state_of = state_of
        for name in COLLECTIVES:
            monkeypatch.setattr(dist, name, self._wrap(name, getattr(dist, name)))
        # On CPU every tensor is on the trainer's device: what shows that a collective's tensor
        # would be on the GPU there is that it went through the trainer's ``Device``.
        device_type = type(state_of().device)
        to_device = device_type.tensor_to_device

        def observed_to_device(device, tensor):
            out = to_device(device, tensor)
            self.moved.append(out)
            return out
        monkeypatch.setattr(device_type, 'tensor_to_device', observed_to_device)

    def went_through_the_device(self, tensor: torch.Tensor) -> bool:
        return any(tensor is t for t in self.moved)

    def _wrap(self, name, original):
        def observed(*args, **kwargs):
            frame, chain = sys._getframe(1), []
            while frame is not None and frame.f_globals.get('__name__', '').startswith('foundrymix'):
                chain.append((frame.f_globals['__name__'].rsplit('.', 1)[-1], frame.f_code.co_name))
                frame = frame.f_back
            if chain:  # (module, the Composer hook that started it)
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                self.calls.append((name, chain[-1][0], chain[-1][1], int(self.state_of().timestamp.batch),
                                   [t.device for t in tensors]))
                self.tensors.extend(tensors)
            return original(*args, **kwargs)
        return observed


def build(streams: dict, d: Path, device: str, **top):
    """A 7-batch run: log interval 3, checkpoints every 2 batches, sample log every 3."""
    from foundrymix.train.builder import build_trainer
    from foundrymix.train.config import TrainConfig

    loader = {'streams': {n: {'local': str(p)} for n, p in streams.items()}, 'num_workers': 0}
    return build_trainer(TrainConfig.from_dict(tiny_run_config(
        loader, global_train_batch_size=4, max_duration='7ba', device=device, save_folder=str(d / 'ckpt'),
        save_interval='2ba', callbacks={
            'stream_accounting': {'out_dir': str(d / 'report'), 'log_interval': '3ba', 'plot': False},
            'sample_log': {'path': str(d / 's.jsonl'), 'interval': '3ba'}}, **top)))


def fit(run) -> None:
    try:
        run.trainer.fit()
    finally:
        run.trainer.close()


@pytest.mark.slow  # two tiny in-process trainings (7 and 3 batches), ~30 s on 2 busy cores
@pytest.mark.parametrize('device', ['cpu', pytest.param('gpu', marks=gpu)])
def test_collectives_are_on_the_trainer_device_at_interval_save_and_end_only(
        small_streams, tmp_path, monkeypatch, device):
    run = build(small_streams, tmp_path, device)
    log = CollectiveLog(monkeypatch, lambda: run.trainer.state)
    fit(run)
    epochs = int(run.trainer.state.timestamp.epoch)
    trainer_device = run.trainer.state.device._device
    monkeypatch.undo()

    # log interval 3: batch_end at 3 and 6; checkpoints at 2, 4, 6 and the last batch 7; the end
    hooks = [('state_dict', 2), ('batch_end', 3), ('state_dict', 4), ('batch_end', 6), ('state_dict', 6),
             ('state_dict', 7), ('fit_end', 7)]
    assert [(c[2], c[3]) for c in log.calls if c[1] == 'accounting'] == hooks
    assert {c[0] for c in log.calls if c[1] == 'accounting'} == {'all_reduce'}
    assert [(c[0], c[2], c[3]) for c in log.calls if c[1] == 'sample_log'] == [
        ('all_gather_object', hook, batch) for hook, batch in hooks]
    s3 = [(c[0], c[2]) for c in log.calls if c[1] == 'run']  # S3Log, in callbacks/run.py
    assert s3 == [('all_gather_object', 'epoch_end')] * epochs + [('all_gather_object', 'fit_end')]
    assert {c[1] for c in log.calls} == {'accounting', 'sample_log', 'run'}
    # every tensor a collective got is on the trainer's device (NCCL: CUDA only)
    devices = [d for c in log.calls for d in c[4]]
    assert len(devices) == len(hooks) and set(devices) == {trainer_device}
    assert all(log.went_through_the_device(t) for t in log.tensors)  # Device.tensor_to_device: CUDA on GPUs
    assert trainer_device.type == ('cuda' if device == 'gpu' else 'cpu')

    # and what they carried is every batch, exactly once
    lines = [json.loads(line) for line in (tmp_path / 's.jsonl').read_text().splitlines()]
    assert [line['batch'] for line in lines] == list(range(7))
    report = json.loads((tmp_path / 'report' / 'stream_accounting.json').read_text())
    assert report['total']['samples'] == 7 * 4
    assert [p['batch'] for p in report['history']] == [3, 6, 7]
    per_stream = [sum(s == i for line in lines for s in line['stream_ids']) for i in range(2)]
    assert [report['streams'][n]['samples'] for n in ('arxiv', 'dolly')] == per_stream

    # the checkpoint at batch 4 (after log point 3) holds batch 4's counts and log lines;
    # resumed from it, the counters and the log continue exactly
    ckpt = tmp_path / 'ckpt' / 'ep0-ba4-rank0.pt'
    saved = torch.load(ckpt, map_location='cpu', weights_only=False)['state']['callbacks']['StreamAccounting']
    assert sum(saved['samples']) == 4 * 4 and saved['history'] == report['history'][:1]
    fit(build(small_streams, tmp_path / 'resumed', device, load_path=str(ckpt)))
    resumed = json.loads((tmp_path / 'resumed' / 'report' / 'stream_accounting.json').read_text())
    assert (resumed['streams'], resumed['total'], resumed['history']) == (
        report['streams'], report['total'], report['history'])
    assert [json.loads(line) for line in (tmp_path / 'resumed' / 's.jsonl').read_text().splitlines()] == lines[4:]

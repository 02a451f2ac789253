"""Adaptive mixing in a real (tiny, CPU, in-process) training run: the loss the policy sees
is the model's, per stream; the run writes every decision to report/mixture.json; a run
stopped inside a segment and right at an update, and resumed, decides, trains and ends
bitwise as the straight one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import tiny_run_config
from train_helpers import assert_same_weights, final_state, sample_log

BATCHES = 12
EVERY = 2


def run_config(root: Path, small_streams, stop_at: str | None = None, plot: bool = False,
               **top) -> dict:
    loader = {'streams': {'arxiv': {'local': str(small_streams['arxiv']), 'proportion': 0.5},
                          'dolly': {'local': str(small_streams['dolly']), 'proportion': 0.5}},
              'epoch_size': 32, 'shuffle_seed': 3, 'num_workers': 0,
              'adaptive': {'method': 'odm', 'every': f'{EVERY}ba', 'min_share': 0.1}}
    callbacks = {'sample_log': {'path': str(root / 'samples.jsonl'), 'interval': '1ba'},
                 'stream_accounting': {'out_dir': str(root / 'report'), 'log_interval': f'{EVERY}ba',
                                       'plot': plot}}
    if stop_at:
        callbacks['stop_at'] = {'time': stop_at}
    return tiny_run_config(loader, run_name='adaptive', global_train_batch_size=4,
                           max_duration=f'{BATCHES}ba', save_folder=str(root / 'ckpt'),
                           callbacks=callbacks, **top)


def fit(cfg: dict):
    from foundrymix.train.builder import train
    from foundrymix.train.config import TrainConfig
    return train(TrainConfig.from_dict(cfg))


def first_segment_loss(small_streams, root: Path) -> list[float]:
    """Each stream's mean loss per loss token over the first segment (batches 0 and 1),
    recomputed through the model's own (HF) loss one row at a time: batch 0 with the initial model,
    batch 1 after Composer trained batch 0 (a fresh trainer's ``fit`` of 1 batch)."""
    from foundrymix.loader.run_loader import StagedDataLoader
    from foundrymix.train.builder import build_trainer
    from foundrymix.train.config import TrainConfig
    assert EVERY == 2
    run = build_trainer(TrainConfig.from_dict(run_config(root, small_streams)))
    loader = StagedDataLoader(run.run_plan)
    it = iter(loader)
    batches = [next(it) for _ in range(EVERY)]
    loader.release()
    sums, tokens = np.zeros(2), np.zeros(2)

    def add(batch) -> None:
        hf = run.trainer.state.model.model  # transformers' model and its own loss
        hf.eval()
        with torch.no_grad():
            for r in range(len(batch['input_ids'])):
                labels = batch['labels'][r:r + 1]
                out = hf(input_ids=batch['input_ids'][r:r + 1], labels=labels, use_cache=False,
                         position_ids=batch['position_ids'][r:r + 1])  # attention: document
                n = int((labels[:, 1:] != -100).sum())
                sums[int(batch['stream_id'][r])] += float(out.loss) * n
                tokens[int(batch['stream_id'][r])] += n
    try:
        add(batches[0])
        run.trainer.fit(duration='1ba')
        add(batches[1])
        return (sums / tokens).tolist()
    finally:
        run.trainer.close()
        run.claims.release()


@pytest.fixture(scope='module')
def straight(tmp_path_factory, small_streams):
    root = tmp_path_factory.mktemp('adaptive-straight')
    run = fit(run_config(root, small_streams, plot=True))
    return root, run


@pytest.mark.slow  # five tiny in-process fits: ~75 s on 2 loaded cores
def test_a_training_run_decides_from_the_model_loss_and_resumes_bitwise(straight, small_streams, tmp_path):
    root, run = straight
    assert (root / 'report' / 'mixture.png').stat().st_size > 0  # the start and the realized shares
    mixture = json.loads((root / 'report' / 'mixture.json').read_text())['stages']['main']
    decisions = mixture['decisions']
    assert [d['batch'] for d in decisions] == list(range(0, BATCHES, EVERY))
    assert len({tuple(d['weights']) for d in decisions}) >= 3  # the policy moved the weights
    # each segment trained exactly its decided rows (counted by the accounting from the batches)
    history = {p['batch']: p['samples'] for p in json.loads(
        (root / 'report' / 'stream_accounting.json').read_text())['history']}
    before = [0, 0]
    for d in decisions:
        end = history[d['batch'] + EVERY]
        assert [e - b for e, b in zip(end, before)] == d['rows']
        before = end
    # the end-of-run table's planned share is the decided rows' share: what was trained
    streams = json.loads((root / 'report' / 'stream_accounting.json').read_text())['streams']
    decided = [sum(d['rows'][i] for d in decisions) for i in range(2)]
    assert [streams[n]['planned_share'] for n in streams] == [r / sum(decided) for r in decided]
    assert [streams[n]['samples'] for n in streams] == decided
    assert decisions[1]['loss'] == pytest.approx(first_segment_loss(small_streams, tmp_path / 'fresh'),
                                                 rel=1e-5)
    samples = sample_log(root / 'samples.jsonl')

    # stopped inside a segment (batch 5: the loss of batch 4 is in the checkpoint), resumed
    # and stopped right at an update (batch 8), then resumed to the end
    resumed_root = tmp_path
    fit(run_config(resumed_root, small_streams, stop_at='5ba', save_interval='5ba'))
    assert len(sample_log(resumed_root / 'samples.jsonl')) == 5
    fit(run_config(resumed_root, small_streams, stop_at='8ba', save_interval='4ba', autoresume=True))
    assert len(sample_log(resumed_root / 'samples.jsonl')) == 8
    fit(run_config(resumed_root, small_streams, autoresume=True))
    again = json.loads((resumed_root / 'report' / 'mixture.json').read_text())['stages']['main']
    assert again['decisions'] == decisions and again['policy'] == mixture['policy']
    assert sample_log(resumed_root / 'samples.jsonl') == samples
    assert_same_weights(final_state(root / 'ckpt'), final_state(resumed_root / 'ckpt'))

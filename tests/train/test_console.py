"""What a run prints: the progress bar on terminals only, and one line saying where a resume starts."""

from __future__ import annotations

import gc
import sys

import pytest
from helpers import tiny_run_config

from foundrymix.train.config import TrainConfig


def cfg_of(loader: dict, tmp_path, **top) -> TrainConfig:
    callbacks = {'stream_accounting': {'out_dir': str(tmp_path / 'report'), 'plot': False}}
    return TrainConfig.from_dict(tiny_run_config(loader, global_train_batch_size=4, callbacks=callbacks, **top))


@pytest.mark.parametrize('tty, setting, bar', [(True, None, True), (False, None, False), (True, False, False),
                                               (False, True, True)])
def test_progress_bar_defaults_to_on_for_terminals(monkeypatch, tmp_path, tty, setting, bar):
    from foundrymix.train.console import console_kwargs

    monkeypatch.setattr(sys.stdout, 'isatty', lambda: tty)
    cfg = cfg_of({'streams': {'a': {'local': '/x'}}}, tmp_path, max_duration='1ba', progress_bar=setting,
                 log_interval='7ba', loggers={'console': {'stream': 'stderr'}})
    assert console_kwargs(cfg) == {'progress_bar': bar, 'log_to_console': True, 'console_log_interval': '7ba',
                                   'console_stream': 'stderr'}


def test_a_resumed_staged_run_says_where_it_resumes(small_streams, tmp_path, capsys):
    from foundrymix.train.builder import build_trainer

    loader = {'streams': {n: {'local': str(p)} for n, p in small_streams.items()}, 'num_workers': 0,
              'stages': [{'name': 'warm', 'duration': '2ba', 'streams': {'arxiv': {'repeat': 1}}},
                         {'name': 'main', 'duration': '3ba', 'streams': {'dolly': {'repeat': 1}}}]}
    first = build_trainer(cfg_of(loader, tmp_path, save_folder=str(tmp_path / 'ckpt'), save_interval='3ba',
                                 loggers={}))
    first.trainer.fit()
    first.trainer.close()
    assert 'resumed from' not in capsys.readouterr().out
    del first
    gc.collect()  # streaming's shared memory for these local dirs is freed with the datasets

    ckpt = tmp_path / 'ckpt' / 'ep0-ba3-rank0.pt'
    again = build_trainer(cfg_of(loader, tmp_path, load_path=str(ckpt), loggers={}))
    again.trainer.close()
    assert capsys.readouterr().out.splitlines() == [
        f"resumed from {ckpt} at batch 3 (epoch 0, batch 3 of it, stage 'main', batch 1 of it)"]

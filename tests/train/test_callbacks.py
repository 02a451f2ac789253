"""The callbacks table: YAML options are typed per callback, and the trainer gets each
callback the YAML names (plus the always-on ones) built from its options."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import tiny_run_config


def config_dict(callbacks: dict, loader: dict | None = None) -> dict:
    loader = loader or {'streams': {'a': {'local': '/nonexistent/a'}}}
    return tiny_run_config(loader, global_train_batch_size=2, max_duration='2ba', callbacks=callbacks)


def test_every_entry_is_a_dataclass_with_defaults_or_required_keys():
    from foundrymix.train.callbacks import CALLBACKS
    assert list(CALLBACKS) == ['stream_accounting', 'sample_log', 'stop_at', 'speed_monitor', 'lr_monitor',
                              'memory_monitor', 'runtime_estimator']
    for name, entry in CALLBACKS.items():
        assert dataclasses.is_dataclass(entry.config), name
        assert callable(entry.factory), name


def test_options_are_typed_per_callback():
    from foundrymix.train.callbacks import NoOptions, SampleLogConfig, SpeedMonitorConfig, StopAtConfig
    from foundrymix.train.config import TrainConfig

    cfg = TrainConfig.from_dict(config_dict({'speed_monitor': {'window_size': 5}, 'lr_monitor': None,
                                             'sample_log': {'path': 's.jsonl'}, 'stop_at': {'time': '3ba'}}))
    assert cfg.callbacks == {'speed_monitor': SpeedMonitorConfig(window_size=5), 'lr_monitor': NoOptions(),
                             'sample_log': SampleLogConfig(path='s.jsonl'), 'stop_at': StopAtConfig(time='3ba')}


@pytest.mark.parametrize('callbacks, message', [
    ({'speed_monitor': {'windw_size': 5}}, "callbacks.speed_monitor: unknown key 'windw_size'"),
    ({'lr_monitor': {'interval': 1}}, "callbacks.lr_monitor: unknown key 'interval'"),
    ({'sampel_log': {}}, "callbacks: unknown key 'sampel_log'"),
])
def test_unknown_callback_keys_are_refused(callbacks, message):
    from foundrymix.config import ConfigError
    from foundrymix.train.config import TrainConfig
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict(config_dict(callbacks))
    assert message in str(err.value)


def test_trainer_gets_the_callbacks_the_yaml_names(small_streams, tmp_path):
    from composer.callbacks import LRMonitor, SpeedMonitor

    from foundrymix.train.builder import build_trainer
    from foundrymix.train.callbacks.accounting import StreamAccounting
    from foundrymix.train.callbacks.sample_log import SampleLog
    from foundrymix.train.callbacks.run import StopAt
    from foundrymix.train.config import TrainConfig

    loader = {'streams': {name: {'local': str(path)} for name, path in small_streams.items()}, 'num_workers': 0}
    cfg = TrainConfig.from_dict(config_dict(
        {'speed_monitor': {'window_size': 3}, 'sample_log': {'path': str(tmp_path / 's.jsonl')},
         'stop_at': {'time': '1ep'}, 'lr_monitor': {}}, loader))
    run = build_trainer(cfg)
    try:
        ours = [c for c in run.trainer.state.callbacks
                if isinstance(c, (StreamAccounting, SpeedMonitor, SampleLog, StopAt, LRMonitor))]
        assert [type(c) for c in ours] == [StreamAccounting, SpeedMonitor, SampleLog, StopAt, LRMonitor]
        assert ours[0] is run.accounting and run.accounting.stream_names == ['arxiv', 'dolly']
        rows = run.run_plan.rows_per_stream  # the plan's rows over the run (1ep: one epoch's)
        assert run.accounting.planned_share == [rows[n] / sum(rows.values()) for n in ('arxiv', 'dolly')]
        assert run.accounting.out_dir == 'runs/foundrymix/report'  # no save_folder, no out_dir
        assert ours[1].history_samples.maxlen == 3 + 1  # SpeedMonitor keeps window_size + 1 points
        assert ours[2].path == str(tmp_path / 's.jsonl')
        assert str(ours[3].time) == '1ep'
    finally:
        run.trainer.close()


@pytest.mark.slow  # a real 1.5-epoch fit: ~40 s on 2 loaded cores
def test_a_run_that_trains_the_plan_shows_equal_planned_and_realized_shares(small_streams, tmp_path):
    """1.5 epochs over a stream with half a pass per epoch: the run's mix is not one epoch's,
    and the table's planned share is the run's (what was trained, exactly)."""
    from foundrymix.plan.config import LoaderConfig
    from foundrymix.plan.mixture import Topology
    from foundrymix.plan.stages import plan_run
    from foundrymix.train.builder import train
    from foundrymix.train.config import TrainConfig
    from foundrymix.train.report import table

    loader = {'streams': {'arxiv': {'local': str(small_streams['arxiv']), 'repeat': 1},
                          'dolly': {'local': str(small_streams['dolly']), 'repeat': 0.5}},
              'shuffle': True, 'shuffle_seed': 3, 'num_workers': 0}
    epoch = plan_run(LoaderConfig.from_dict(loader), 8, '1ep', Topology())[0].stages[0].plan
    batches = epoch.batches_per_epoch * 3 // 2
    cfg = TrainConfig.from_dict({**config_dict(
        {'stream_accounting': {'out_dir': str(tmp_path / 'report'), 'plot': False}}, loader),
        'global_train_batch_size': 8, 'max_duration': f'{batches}ba'})
    run = train(cfg)
    summary = run.accounting.summary(run.trainer.state)
    realized = [summary['streams'][n]['share'] for n in ('arxiv', 'dolly')]
    per_epoch = [s.share for s in epoch.streams]
    assert realized != per_epoch  # the case this is about: the run's mix is not an epoch's
    assert [summary['streams'][n]['planned_share'] for n in ('arxiv', 'dolly')] == realized
    rendered = table(summary)
    assert list(rendered.columns[4].cells) == list(rendered.columns[5].cells)  # share | planned share

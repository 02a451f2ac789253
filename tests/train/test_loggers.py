"""``loggers:``: typed options, a clear error for a missing extra, and metrics that arrive.

Each optional logger gets a real 4-batch Composer run (tiny Llama, CPU) that logs the
per-stream accounting every 2 batches; the metrics are then read back with that
library's own reader (tensorboard's ``EventAccumulator``, ``MlflowClient``, the wandb
offline run file) and compared with the run's own accounting history.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers import tiny_run_config

from foundrymix.config import ConfigError
from foundrymix.train.config import TrainConfig

KEYS = ('tokens', 'loss_tokens', 'share', 'planned_share', 'loss')


def config(loggers: dict, streams: dict | None = None, tmp: Path | None = None) -> TrainConfig:
    loader = {'streams': {n: {'local': str(p)} for n, p in (streams or {'a': '/x'}).items()}, 'num_workers': 0}
    callbacks = {'stream_accounting': {'log_interval': '2ba', 'out_dir': str(tmp / 'report'), 'plot': False}} \
        if tmp else {}
    return TrainConfig.from_dict(tiny_run_config(loader, global_train_batch_size=4, max_duration='4ba',
                                                 run_name='logged', loggers=loggers, callbacks=callbacks))


@pytest.mark.parametrize('loggers, message', [
    ({'tensorbord': {}}, "loggers: unknown key 'tensorbord'; allowed: console, file, tensorboard, mlflow, wandb"),
    ({'mlflow': {'tracking_url': 'file:x'}}, "loggers.mlflow: unknown key 'tracking_url'"),
    ({'wandb': {'mode': 'offlin'}}, "loggers.wandb.mode: 'offlin' is not one of online, offline, disabled"),
    ({'tensorboard': {'flush_interval': 'often'}}, "loggers.tensorboard.flush_interval: expected int, got 'often'"),
    ({'console': {'stream': 'stdrr'}}, "loggers.console.stream: 'stdrr' is not one of stdout, stderr"),
])
def test_logger_options_are_typed(loggers, message):
    with pytest.raises(ConfigError) as err:
        config(loggers)
    assert message in str(err.value)


@pytest.mark.parametrize('name, module', [('tensorboard', 'tensorboard'), ('mlflow', 'mlflow'), ('wandb', 'wandb')])
def test_a_missing_package_names_the_extra(monkeypatch, name, module):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda m, *a: None if m == module else real(m, *a))
    with pytest.raises(ConfigError) as err:
        config({name: {}})
    assert str(err.value) == (f"loggers.{name}: the {name} logger needs the {module!r} package: "
                              f"pip install 'foundrymix[{name}]'")


def run_logged(loggers: dict, small_streams, tmp_path: Path) -> dict:
    """Train 4 batches; the accounting history points (batches 2 and 4) keyed by metric name."""
    from foundrymix.train.builder import build_trainer

    run = build_trainer(config(loggers, small_streams, tmp_path))
    run.trainer.fit()
    run.trainer.close()
    history = run.accounting.history
    assert [p['batch'] for p in history] == [2, 4]
    names = run.accounting.stream_names
    expected = {}
    before = {'loss_sum': [0.0] * len(names), 'loss_targets': [0] * len(names)}
    for point in history:
        samples, total = point['samples'], sum(point['samples'])
        for i, name in enumerate(names):
            # the loss since the previous point: that interval's summed loss over its targets
            # (none when the stream had no loss target in the interval: nothing is logged)
            targets = point['loss_targets'][i] - before['loss_targets'][i]
            loss = (point['loss_sum'][i] - before['loss_sum'][i]) / targets if targets else None
            values = {'tokens': point['tokens'][i], 'loss_tokens': point['loss_tokens'][i],
                      'share': samples[i] / total, 'planned_share': run.accounting.planned_share[i], 'loss': loss}
            for key in KEYS:
                if values[key] is None:
                    continue
                expected.setdefault(f'streams/{name}/{key}', []).append((point['batch'], values[key]))
        before = point
    return expected


def assert_series(read: dict, expected: dict) -> None:
    for key, series in expected.items():
        assert [s for s, _ in read[key]] == [s for s, _ in series], key
        assert [v for _, v in read[key]] == pytest.approx([v for _, v in series], rel=1e-6), key
    assert read['loss/train/total'], 'the training loss arrived too'


def test_tensorboard_gets_the_stream_metrics(small_streams, tmp_path):
    pytest.importorskip('tensorboard')
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    expected = run_logged({'tensorboard': {'log_dir': str(tmp_path / 'tb')}}, small_streams, tmp_path)
    [events] = {p.parent for p in (tmp_path / 'tb').rglob('events.out.tfevents.*')}
    acc = EventAccumulator(str(events))
    acc.Reload()
    read = {k: [(e.step, e.value) for e in acc.Scalars(k)] for k in acc.Tags()['scalars']}
    assert_series(read, expected)


def test_mlflow_gets_the_stream_metrics_in_a_local_file_store(small_streams, tmp_path, monkeypatch):
    pytest.importorskip('mlflow')
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv('MLFLOW_ALLOW_FILE_STORE', 'true')
    monkeypatch.chdir(tmp_path)  # the default store is runs/<run_name>/mlruns under the working directory
    expected = run_logged({'mlflow': {}}, small_streams, tmp_path)
    client = MlflowClient(tracking_uri=f'file:{tmp_path / "runs" / "logged" / "mlruns"}')
    [run] = client.search_runs([client.get_experiment_by_name('logged').experiment_id])
    read = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
            for k in [*expected, 'loss/train/total']}
    assert_series(read, expected)


def wandb_records(path: Path):
    """The protobuf records of a wandb ``.wandb`` run file (wandb >= 0.20 ships no Python reader).

    The file is ``:W&B`` + 3 header bytes, then a LevelDB log: 32 KiB blocks of chunks,
    each with a 7-byte header (crc32c, little-endian length, type 1 full / 2 first /
    3 middle / 4 last); a block tail under 7 bytes is padding.
    """
    import struct

    block, data = 32768, path.read_bytes()
    assert data[:4] == b':W&B'
    pos, parts = 7, b''
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack('<IHB', data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # padding to the end of the block
            pos += left
            continue
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield parts
            parts = b''


def wandb_history(run_file: Path) -> dict:
    """Metric series (``_step``, value) from a wandb offline run file, parsed with wandb's protobufs."""
    import json

    from wandb.proto import wandb_internal_pb2

    read: dict = {}
    for data in wandb_records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof('record_type') != 'history':
            continue
        items = {i.key or '/'.join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
        for key, value in items.items():
            read.setdefault(key, []).append((items['_step'], value))
    return read


def test_wandb_offline_gets_the_stream_metrics(small_streams, tmp_path, monkeypatch):
    wandb = pytest.importorskip('wandb')
    monkeypatch.setenv('WANDB_MODE', 'offline')
    monkeypatch.setenv('WANDB_SILENT', 'true')
    expected = run_logged({'wandb': {'project': 'fm', 'dir': str(tmp_path / 'wb')}}, small_streams, tmp_path)
    wandb.teardown()  # the wandb-core service writes the run file out when it shuts down (as at exit)
    [run_file] = (tmp_path / 'wb' / 'wandb').glob('offline-run-*/run-*.wandb')
    assert_series(wandb_history(run_file), expected)

"""Per-stream accounting without a training process: the counting callback fed real
collated batches (and a real tiny model's loss on them, in microbatches as Composer runs
them), its checkpoint state, the report writer and ``foundrymix report``.

Counts are checked against numpy counts taken from the same batches (``stream_id``,
``attention_mask``, ``labels``) and against what the streams must hold (pretrain rows
are full and all loss; one epoch holds every row of a ``repeat: 1`` stream once). Loss
sums are checked against transformers' own loss of every row on its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import ROOT, SMALL_SEQ

PNG_MAGIC = b'\x89PNG\r\n\x1a\n'
BATCH = 6
NAMES = ['arxiv', 'dolly']


class RecordingLogger:
    """Stands in for Composer's ``Logger``: keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def log_metrics(self, metrics: dict) -> None:
        self.calls.append(dict(metrics))


def state_at(batch, n_batch: int, epoch: int = 0, batch_in_epoch: int | None = None,
             outputs=None) -> SimpleNamespace:
    from composer.core import Timestamp
    in_epoch = n_batch if batch_in_epoch is None else batch_in_epoch
    return SimpleNamespace(batch=batch, outputs=outputs,
                           timestamp=Timestamp(epoch=epoch, batch=n_batch, batch_in_epoch=in_epoch))


MICRO = 4  # microbatch rows: a batch of 6 is run as 4 + 2, as Composer splits it


@pytest.fixture(scope='module')
def one_thread():
    """torch on one thread while the tiny model runs: on 2 busy cores its 2 threads made a
    row's forward ~16x slower (450 ms against 28 ms, measured)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope='module')
def epoch_batches(small_streams, one_thread) -> list:
    """One epoch of real collated batches over the small streams (every row once), and a tiny
    model's outputs (with ``row_loss``) on each batch's microbatches."""
    import torch
    from helpers import tiny_run_config
    from foundrymix.loader.mixer import StreamMixer
    from foundrymix.train.model import CausalLM, ModelSpec, build_hf_model
    mixer = StreamMixer.from_dict({'streams': {name: {'local': str(small_streams[name])} for name in NAMES},
                                   'shuffle': True, 'shuffle_seed': 11, 'num_workers': 0})
    batches = list(mixer.build_dataloader(batch_size=BATCH))
    rows = {name: m.counts.rows for name, m in mixer.manifests.items()}
    torch.manual_seed(0)
    spec = ModelSpec.from_dict(tiny_run_config({})['model'])
    model = CausalLM(build_hf_model(spec, mixer.tokenizer, SMALL_SEQ)).eval()
    outputs = []
    with torch.no_grad():
        for b in batches:
            outputs.append([])
            for i in range(0, BATCH, MICRO):
                micro = {k: v[i:i + MICRO] for k, v in b.items()}
                out = model(micro)
                model.loss(out, micro)  # leaves out.row_loss, as in training
                outputs[-1].append((micro, out))
    return batches, rows, outputs, model


def numpy_counts(batches) -> np.ndarray:
    """(samples, tokens, loss tokens) x stream, from the batches with numpy only."""
    out = np.zeros((3, len(NAMES)), dtype=np.int64)
    for b in batches:
        sid = b['stream_id'].numpy().reshape(-1)
        out[0] += np.bincount(sid, minlength=len(NAMES))
        out[1] += np.bincount(sid, weights=b['attention_mask'].numpy().sum(axis=1), minlength=len(NAMES)).astype(np.int64)
        out[2] += np.bincount(sid, weights=(b['labels'].numpy() != -100).sum(axis=1),
                              minlength=len(NAMES)).astype(np.int64)
    return out


def new_accounting(tmp_path, **kw):
    from foundrymix.train.callbacks.accounting import StreamAccounting
    return StreamAccounting(NAMES, [0.25, 0.75], out_dir=str(tmp_path / 'report'), **kw)


def feed(acc, batches, logger, start: int = 0, outputs=None, retry: bool = False) -> None:
    """The callback's events for each batch, in Composer 0.32's order; with ``outputs``,
    ``after_loss`` per microbatch. ``retry``: each batch's first microbatch runs once more
    first, then the batch restarts, as Composer's auto microbatching does after an OOM."""
    for k, b in enumerate(batches, start=start):
        acc.after_dataloader(state_at(b, k), logger)
        micro = outputs[k - start] if outputs else []
        for attempt in ([micro[:1], micro] if retry else [micro]):
            acc.before_train_batch(state_at(b, k), logger)
            for m, out in attempt:
                acc.after_loss(state_at(m, k, outputs=out), logger)
        acc.after_train_batch(state_at(b, k), logger)
        acc.batch_end(state_at(b, k + 1), logger)


@pytest.fixture(scope='module')
def hf_rows(epoch_batches, one_thread) -> list:
    """Per batch, per row: (stream, transformers' own loss of the row run alone x its targets, targets)."""
    import torch
    batches, _, _, model = epoch_batches
    out = []
    with torch.no_grad():
        for b in batches:
            out.append([])
            for r in range(len(b['stream_id'])):
                labels = b['labels'][r:r + 1]
                n = int((labels[:, 1:] != -100).sum())
                loss = model.model(input_ids=b['input_ids'][r:r + 1], position_ids=b['position_ids'][r:r + 1],
                                   labels=labels).loss
                out[-1].append((int(b['stream_id'][r]), float(loss) * n, n))
    return out


def per_stream(rows) -> tuple[np.ndarray, np.ndarray]:
    """(loss sum, loss targets) per stream over some batches of :func:`hf_rows`."""
    sums, targets = np.zeros(len(NAMES)), np.zeros(len(NAMES), dtype=np.int64)
    for batch in rows:
        for stream, loss_sum, n in batch:
            sums[stream] += loss_sum
            targets[stream] += n
    return sums, targets


def test_counts_equal_numpy_counts_of_the_batches(tmp_path, epoch_batches):
    batches, rows, outputs, _ = epoch_batches
    acc, logger = new_accounting(tmp_path, log_interval='2ba'), RecordingLogger()
    feed(acc, batches, logger, outputs=outputs)
    expected = numpy_counts(batches)
    assert acc.samples.tolist() == expected[0].tolist()
    assert acc.tokens.tolist() == expected[1].tolist()
    assert acc.loss_tokens.tolist() == expected[2].tolist()
    # what the streams must hold: one epoch of repeat-1 streams is every row once, up to
    # the last partial batch; pretrain rows are full and all loss, finetune rows are not.
    assert acc.samples.sum() == len(batches) * BATCH
    assert rows['arxiv'] + rows['dolly'] - BATCH < acc.samples.sum() <= rows['arxiv'] + rows['dolly']
    assert acc.tokens[0] == acc.loss_tokens[0] == acc.samples[0] * SMALL_SEQ
    assert acc.loss_tokens[1] < acc.tokens[1] < acc.samples[1] * SMALL_SEQ

    summary = acc.summary()
    total = summary['total']
    assert {k: total[k] for k in ('samples', 'tokens', 'loss_tokens')} == {
        'samples': int(expected[0].sum()), 'tokens': int(expected[1].sum()), 'loss_tokens': int(expected[2].sum())}
    for i, name in enumerate(NAMES):
        s = summary['streams'][name]
        assert (s['samples'], s['tokens'], s['loss_tokens']) == tuple(int(x) for x in expected[:, i])
        assert s['share'] == expected[0, i] / expected[0].sum()
        assert s['token_share'] == expected[1, i] / expected[1].sum()
        assert s['planned_share'] == [0.25, 0.75][i]
    # a history point and a metrics call every 2 batches, cumulative
    assert [p['batch'] for p in acc.history] == list(range(2, len(batches) + 1, 2))
    assert len(logger.calls) == len(acc.history)
    half = numpy_counts(batches[:2])
    point = dict(acc.history[0])
    assert point.pop('loss_sum') and point.pop('loss_targets')
    assert point == {'batch': 2, 'epoch': 0, 'samples': half[0].tolist(), 'tokens': half[1].tolist(),
                     'loss_tokens': half[2].tolist()}
    assert logger.calls[0]['streams/dolly/loss_tokens'] == half[2, 1]
    assert logger.calls[0]['streams/arxiv/planned_share'] == 0.25
    assert logger.calls[0]['streams/epoch'] == 0


def test_stream_loss_equals_transformers_loss_of_each_row(tmp_path, epoch_batches, hf_rows):
    """Loss summed per stream over microbatches equals transformers' loss of each row alone x its
    targets; the logged loss is each interval's, the summary's the run's; hooks see each reduction."""
    batches, _, outputs, _ = epoch_batches
    acc, logger = new_accounting(tmp_path, log_interval='2ba'), RecordingLogger()
    seen = []
    acc.add_reduce_hook(seen.append)
    feed(acc, batches, logger, outputs=outputs)
    sums, targets = per_stream(hf_rows)
    assert acc.loss_targets.tolist() == targets.tolist()
    # the targets: every labelled token but a row's first position (transformers' shift)
    first = np.array([sum(int(b['labels'][r, 0] != -100) for b in batches for r in range(BATCH)
                          if int(b['stream_id'][r]) == i) for i in range(len(NAMES))])
    assert (targets == numpy_counts(batches)[2] - first).all() and first[0] == acc.samples[0]
    np.testing.assert_allclose(acc.loss_sum, sums, rtol=2e-6)
    summary = acc.summary()
    for i, name in enumerate(NAMES):
        assert summary['streams'][name]['loss_targets'] == targets[i]
        assert summary['streams'][name]['loss'] == pytest.approx(sums[i] / targets[i], rel=2e-6)
    assert summary['total']['loss'] == pytest.approx(sums.sum() / targets.sum(), rel=2e-6)
    # logged every 2 batches: the loss of those 2 batches, per stream
    two_sums, two_targets = per_stream(hf_rows[2:4])
    for i, name in enumerate(NAMES):
        assert logger.calls[1][f'streams/{name}/loss'] == pytest.approx(two_sums[i] / two_targets[i], rel=2e-6)
    # one hook call per reduction (every 2 batches), each with that reduction's sums
    assert [r.batch for r in seen] == list(range(2, len(batches) + 1, 2))
    assert seen[1].loss_targets.tolist() == two_targets.tolist()
    np.testing.assert_allclose(seen[1].loss_sum, two_sums, rtol=2e-6)
    got_sums, got_targets = acc.reduced_loss()
    assert (got_sums.tolist(), got_targets.tolist()) == (seen[-1].loss_sum.tolist(), seen[-1].loss_targets.tolist())
    np.testing.assert_array_equal(np.sum([r.loss_sum for r in seen], axis=0), acc.loss_sum)
    # a batch rerun after an out-of-memory microbatch counts its loss once
    retried = new_accounting(tmp_path, log_interval='2ba')
    feed(retried, batches, RecordingLogger(), outputs=outputs, retry=True)
    assert retried.state_dict() == acc.state_dict()


def test_state_dict_round_trip(tmp_path, epoch_batches):
    batches, _, outputs, _ = epoch_batches
    first, rest = batches[:3], batches[3:]
    straight = new_accounting(tmp_path, log_interval='1ba')
    feed(straight, batches, RecordingLogger(), outputs=outputs)

    stopped = new_accounting(tmp_path, log_interval='1ba')
    feed(stopped, first, RecordingLogger(), outputs=outputs)
    saved = json.loads(json.dumps(stopped.state_dict()))  # what a checkpoint can hold
    resumed = new_accounting(tmp_path, log_interval='1ba')
    resumed.load_state_dict(saved)
    assert resumed.summary() == stopped.summary() and resumed.history == stopped.history
    feed(resumed, rest, RecordingLogger(), start=len(first), outputs=outputs[len(first):])
    assert resumed.state_dict() == straight.state_dict()  # loss sums too: bitwise
    assert resumed.loss_targets.sum() > 0

    from foundrymix.train.callbacks.accounting import StreamAccounting
    other = StreamAccounting(['dolly', 'arxiv'], [0.5, 0.5], out_dir=str(tmp_path))
    with pytest.raises(ValueError, match='resuming a different mixture'):
        other.load_state_dict(saved)


def test_fit_end_writes_the_report(tmp_path, epoch_batches):
    batches, _, _, _ = epoch_batches
    acc = new_accounting(tmp_path, log_interval='4ba')
    feed(acc, batches[:5], RecordingLogger())
    acc.fit_end(state_at(None, 5, epoch=0), RecordingLogger())  # records the last point, then writes
    written = json.loads((tmp_path / 'report' / 'stream_accounting.json').read_text())
    assert written == {**acc.summary(state_at(None, 5)), 'history': acc.history}
    assert [p['batch'] for p in written['history']] == [4, 5]
    assert written['batch'] == 5 and written['epoch'] == 0
    assert (tmp_path / 'report' / 'stream_accounting.png').read_bytes().startswith(PNG_MAGIC)


def hand_made_summary() -> dict:
    return {
        'streams': {
            'web': {'samples': 30, 'tokens': 30 * 64, 'loss_tokens': 30 * 64, 'share': 0.75,
                    'token_share': 1920 / 2400, 'planned_share': 0.7, 'loss': 2.71828, 'loss_targets': 30 * 63},
            'chat': {'samples': 10, 'tokens': 480, 'loss_tokens': 200, 'share': 0.25,
                     'token_share': 480 / 2400, 'planned_share': 0.3},
        },
        'total': {'samples': 40, 'tokens': 2400, 'loss_tokens': 2120},
        'batch': 10,
        'epoch': 1,
        'history': [
            {'batch': 5, 'epoch': 0, 'samples': [14, 6], 'tokens': [896, 300], 'loss_tokens': [896, 120]},
            {'batch': 10, 'epoch': 1, 'samples': [30, 10], 'tokens': [1920, 480], 'loss_tokens': [1920, 200]},
        ],
    }


def test_report_writer_on_a_hand_made_summary(tmp_path):
    from foundrymix.train.report import write_report
    summary = hand_made_summary()
    write_report(summary, str(tmp_path / 'r'))
    assert (tmp_path / 'r' / 'stream_accounting.json').read_text(encoding='utf-8') == json.dumps(summary, indent=2)
    png = (tmp_path / 'r' / 'stream_accounting.png').read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000

    write_report(summary, str(tmp_path / 'no-plot'), plot=False)
    write_report({**summary, 'history': []}, str(tmp_path / 'no-history'))
    for d in ('no-plot', 'no-history'):
        assert sorted(p.name for p in (tmp_path / d).iterdir()) == ['stream_accounting.json']


def test_report_cli_rerenders_table_and_plot(tmp_path, capsys):
    from foundrymix.cli import main
    from foundrymix.train.report import write_report
    summary = hand_made_summary()
    write_report(summary, str(tmp_path))
    png = tmp_path / 'stream_accounting.png'
    first = png.read_bytes()
    png.unlink()

    assert main(['report', str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert 'per-stream accounting after 10 batches (1 full epochs)' in out
    # the loss column: 4 decimals; '-' for a stream without one (a summary from before per-stream loss)
    for cells in (('web', '30', '1,920', '1,920', '75.00%', '70.00%', '2.7183'),
                  ('chat', '10', '480', '200', '25.00%', '30.00%', '-')):
        line = next(line for line in out.splitlines() if f' {cells[0]} ' in line)
        assert [seg.strip() for seg in line.split('│')[1:-1]] == list(cells)
    assert png.read_bytes() == first  # the same plot, from the JSON alone
    assert json.loads((tmp_path / 'stream_accounting.json').read_text()) == summary  # untouched

    png.unlink()
    assert main(['report', str(tmp_path / 'stream_accounting.json'), '--no-plot']) == 0
    assert not png.exists()
    assert main(['report', str(tmp_path / 'missing')]) == 2
    assert 'foundrymix report: error: ' in capsys.readouterr().err


def test_config_and_report_modules_do_not_import_torch():
    code = ('import sys; import foundrymix.train.callbacks, foundrymix.train.report, foundrymix.cli; '
            'foundrymix.cli.build_parser(); '
            'print(sorted(m for m in ("torch", "composer", "matplotlib") if m in sys.modules))')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == '[]'

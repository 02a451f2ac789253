"""The README's main command and the example YAMLs, on the bundled samples.

``scripts/demo.sh`` runs for real (conversion of both full samples, inspect, plan,
training) with a short ``max_duration`` so the suite stays fast; every YAML in
``yamls/`` must build a trainer (model, mixer, plan) on the demo's data. What the demo
wrote is checked against independent sources: streaming's own ``StreamingDataset`` over
the output directories and a count by hand with the ``tokenizers`` library.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, SAMPLES

pytestmark = pytest.mark.slow  # the whole demo: two conversions and a training run
SEQ = 256


@pytest.fixture(scope='module')
def demo(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp('demo') / 'out'
    env = {**os.environ, 'OUT': str(out)}
    proc = subprocess.run(['bash', str(ROOT / 'scripts' / 'demo.sh'), 'max_duration=6ba', 'save_interval=3ba'],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, f'{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}'
    return out, proc


def test_demo_runs_end_to_end(demo):
    out, proc = demo
    for name, kind in (('arxiv', 'pretrain'), ('dolly', 'finetune')):
        manifest = json.loads((out / 'data' / name / 'foundrymix.json').read_text())
        assert manifest['kind'] == kind and manifest['max_seq_len'] == 256
        rows = stored_rows(out / 'data' / name)
        assert_rows_match_counts(rows, manifest['counts'])
        if name == 'arxiv':
            assert_pretrain_rows_by_hand(rows, manifest['counts'])
    report = json.loads((out / 'report' / 'stream_accounting.json').read_text())
    assert report['batch'] == 6
    assert report['total']['samples'] == 6 * 8
    assert set(report['streams']) == {'arxiv', 'dolly'}
    assert (out / 'report' / 'stream_accounting.png').exists()
    ckpts = sorted(p.name for p in (out / 'checkpoints').iterdir())
    assert 'ep0-ba3-rank0.pt' in ckpts and 'ep0-ba6-rank0.pt' in ckpts
    assert 'per-stream accounting after 6 batches' in proc.stdout
    assert 'stream_accounting.png' in proc.stdout


@pytest.mark.parametrize('yaml_name', sorted(p.name for p in (ROOT / 'yamls').glob('*.yaml')))
def test_example_yaml_builds(demo, tmp_path, yaml_name, monkeypatch):
    """Each example config validates against real shards and builds a trainer."""
    from composer.core import Time

    from foundrymix.train.builder import build_trainer
    from foundrymix.train.config import load_config

    out, _ = demo
    # pretrain/finetune examples read ${variables.out}/data/<name>; mixed reads ${variables.data}.
    (tmp_path / 'data').symlink_to(out / 'data')
    monkeypatch.chdir(tmp_path)
    cfg = load_config(str(ROOT / 'yamls' / yaml_name),
                      [f'variables.out={tmp_path}', f'variables.data={tmp_path / "data"}'])
    from foundrymix.loader.mixer import build_store
    run = build_trainer(cfg)
    try:
        if cfg.train_loader.stages is not None:
            check_staged_example(run, yaml_name)
            return
        assert run.plan.streams and all(s.rows_per_epoch > 0 for s in run.plan.streams)
        # The plan (our arithmetic on manifests) against the store the trainer reads (rows
        # counted from the index files) and streaming's own Stream.apply_weights.
        stage = run.run_plan.stages[0]
        store = build_store(stage.config, stage.infos)
        store.release()
        streams, size = streaming_weights(stage.infos, stage.plan.weights, stage.config.shuffle_seed,
                                         stage.config.weights_in)
        assert [s.name for s in run.plan.streams] == list(raw_yaml(yaml_name)['train_loader']['streams'])
        assert [s.rows for s in run.plan.streams] == np.diff([*store.sample_offset_per_stream,
                                                              store.num_samples]).tolist()
        assert [s.rows_per_epoch for s in run.plan.streams] == [int(s.choose) for s in streams]
        assert run.plan.epoch_size == size
        # The model the trainer holds is the one the YAML describes (read with plain yaml).
        model = raw_yaml(yaml_name)['model']
        hf = run.trainer.state.model.model.config
        assert hf.model_type == model.pop('type')
        model.pop('attention', None)
        assert model and {key: getattr(hf, key) for key in model} == model
        assert run.trainer.state.max_duration == Time.from_timestring(str(raw_yaml(yaml_name)['max_duration']))
    finally:
        run.trainer.close()


def streaming_weights(infos, weights, seed, weights_in):
    """(streams, epoch size) from streaming's own ``Stream.apply_weights`` for the plan's
    epoch weights: the meaning a weight has in streaming, which the plan must keep."""
    from streaming import Stream

    from foundrymix.plan.exact import row_proportions
    if weights.chooses is not None:
        streams = [Stream(local=i.local, choose=int(c)) for i, c in zip(infos, weights.chooses)]
    else:
        streams = [Stream(local=i.local, repeat=i.spec.repeat, proportion=p, choose=i.spec.choose)
                   for i, p in zip(infos, row_proportions(infos, weights_in))]
    rows = np.array([i.rows for i in infos], np.int64)
    return streams, Stream.apply_weights(streams, rows, weights.epoch_size, seed)


def check_staged_example(run, yaml_name: str) -> None:
    """A staged example: every stage's plan against the dataset streaming builds for it."""
    import gc

    from composer.core import Time
    stages = raw_yaml(yaml_name)['train_loader']['stages']
    assert [s.name for s in run.plan.stages] == [s['name'] for s in stages]
    for stage in run.plan.stages:
        streams, size = streaming_weights(stage.infos, stage.plan.weights, stage.config.shuffle_seed,
                                         stage.config.weights_in)
        assert [s.name for s in stage.plan.streams] == list(stages[stage.index]['streams'])
        assert [s.rows_per_epoch for s in stage.plan.streams] == [int(s.choose) for s in streams]
        assert stage.plan.epoch_size == size
        gc.collect()
    assert run.trainer.state.max_duration == Time.from_timestring(f'{sum(s.batches for s in run.plan.stages)}ba')


def raw_yaml(name: str) -> dict:
    import yaml
    return yaml.safe_load((ROOT / 'yamls' / name).read_text())


def stored_rows(directory: Path) -> list[dict]:
    """Every row of an MDS directory, in order, as streaming's ``StreamingDataset`` reads it."""
    from streaming import StreamingDataset
    dataset = StreamingDataset(local=str(directory), batch_size=1)
    return [dataset[i] for i in range(dataset.num_samples)]


def assert_rows_match_counts(rows: list[dict], counts: dict) -> None:
    """The manifest's counts against the stored rows (columns as the schema stores them)."""
    assert counts['rows'] == len(rows)
    assert all(len(r['input_ids']) == SEQ for r in rows)
    real = sum(int(np.sum(r['doc_lens'])) for r in rows)        # tokens of documents / examples
    spans = [np.asarray(r['loss_spans']).reshape(-1, 2) for r in rows]
    assert counts['tokens'] == real
    assert counts['pad_tokens'] == len(rows) * SEQ - real
    assert counts['loss_tokens'] == sum(int((s[:, 1] - s[:, 0]).sum()) for s in spans)


def assert_pretrain_rows_by_hand(rows: list[dict], counts: dict) -> None:
    """Pretrain: every paper tokenized alone (no BOS, EOS after each), all concatenated and
    cut into rows of 256; the stored rows are exactly that token stream, the rest is the tail."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(ROOT / 'foundrymix' / 'assets' / 'tokenizers' / 'foundrymix-bpe-8k'
                                  / 'tokenizer.json'))
    eos = tok.token_to_id('<|endoftext|>')
    with open(SAMPLES / 'arxiv_sample.jsonl', encoding='utf-8') as f:
        papers = [json.loads(line)['text'] for line in f if line.strip()]
    stream = [t for text in papers for t in tok.encode(text, add_special_tokens=False).ids + [eos]]
    n_rows = len(stream) // SEQ
    assert (counts['rows'], counts['tokens'], counts['tail_tokens'], counts['pad_tokens']) == (
        n_rows, n_rows * SEQ, len(stream) - n_rows * SEQ, 0)
    assert counts['documents_read'] == len(papers)
    stored = np.concatenate([np.asarray(r['input_ids']) for r in rows])
    assert stored.tolist() == stream[:n_rows * SEQ]


def test_readme_quotes_the_demos_first_loss(demo):
    """The README's loss line (printed by ``scripts/readme_figures.py``) against the demo's log.

    The loss at batch 1 is the initial model's on the first batch, the same in this
    6-batch run as in the demo's 300: it must equal the README's figure to the 4 decimals
    Composer prints. (The figure at batch 300 needs the whole run: readme_figures.py.)
    """
    import importlib.util

    spec = importlib.util.spec_from_file_location('readme_figures', ROOT / 'scripts' / 'readme_figures.py')
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    _, proc = demo
    quoted = figures.README_LOSS.search((ROOT / 'README.md').read_text(encoding='utf-8'))
    assert quoted, 'README.md has no "the loss falls from A at batch 1 to B at batch N" line'
    printed = figures.losses(proc.stdout)
    assert sorted(printed)[:1] == [1] and quoted.group(1) == printed[1]
    import yaml
    demo_yaml = yaml.safe_load((ROOT / 'yamls' / 'demo.yaml').read_text(encoding='utf-8'))
    assert f'{quoted.group(3)}ba' == demo_yaml['max_duration']  # the last batch of the demo's run

"""``foundrymix compare RUN_A RUN_B``: equal parts, the first difference, bad input.

The equal case on real runs is in ``tests/train/test_train.py`` (a resumed run against the
straight one). Here two short real runs that differ -- another shuffle seed and another
model seed -- and the first difference the command names is recomputed from the files
themselves (the logs, the summaries, the checkpoints' tensors); bad input exits 2 naming
what is missing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers import tiny_run_config
from train_helpers import sample_log, train

from foundrymix.cli import main

BATCH = 4


def short_run(run: Path, data: dict[str, str], *overrides: str) -> Path:
    loader = {'streams': {'arxiv': {'local': data['arxiv'], 'repeat': 1},
                          'dolly': {'local': data['dolly'], 'repeat': 0.5}},
              'shuffle_seed': 3, 'num_workers': 0}
    cfg = tiny_run_config(loader, run_name='cmp', global_train_batch_size=BATCH, max_duration='4ba',
                          save_folder=str(run / 'ckpt'),
                          callbacks={'sample_log': {'path': str(run / 'samples.jsonl')},
                                     'stream_accounting': {'out_dir': str(run / 'report')}})
    run.mkdir(parents=True)
    (run / 'c.yaml').write_text(yaml.safe_dump(cfg), encoding='utf-8')
    train(run / 'c.yaml', *overrides)
    return run


@pytest.fixture(scope='module')
def runs(tmp_path_factory, small_streams) -> tuple[Path, Path]:
    data = {n: str(p) for n, p in small_streams.items()}
    root = tmp_path_factory.mktemp('compare')
    return (short_run(root / 'a', data),
            short_run(root / 'b', data, 'train_loader.shuffle_seed=4', 'seed=6'))


@pytest.mark.slow  # two train.py runs
def test_a_different_run_names_its_first_difference(runs, capsys):
    a, b = runs
    assert main(['compare', str(a), str(b)]) == 1
    out = capsys.readouterr().out.splitlines()
    # the first batch whose samples differ as a set, and in it the first row each side has
    # alone, found here from the two logs (no sample twice in a batch of these runs)
    la, lb = sample_log(a / 'samples.jsonl'), sample_log(b / 'samples.jsonl')
    batch = next(x['batch'] for x, y in zip(la, lb) if set(x['sample_ids']) != set(y['sample_ids']))
    x, y = la[batch], lb[batch]
    ra = next(r for r in range(BATCH) if x['sample_ids'][r] not in y['sample_ids'])
    rb = next(r for r in range(BATCH) if y['sample_ids'][r] not in x['sample_ids'])
    names = list(json.loads((a / 'report' / 'stream_accounting.json').read_text())['streams'])
    sa = f"sample {x['sample_ids'][ra]} ({names[x['stream_ids'][ra]]})"
    sb = f"sample {y['sample_ids'][rb]} ({names[y['stream_ids'][rb]]})"
    if ra == rb:
        assert out[0] == (f'samples:    differ: batch {batch}, row {ra} of {BATCH} (rank 0 of 1, its '
                          f'row {ra}): A {sa}, B {sb}')
    else:
        assert out[0] == (f'samples:    differ: batch {batch}: A {sa} at row {ra} of {BATCH} (rank 0 of 1, '
                          f"its row {ra}) is not in B's batch, B {sb} at row {rb} is not in A's")
    # the accounting: the first stream whose counts differ (or equal, if the seeds chose alike)
    ra = json.loads((a / 'report' / 'stream_accounting.json').read_text())['streams']
    rb = json.loads((b / 'report' / 'stream_accounting.json').read_text())['streams']
    first = next(((n, k) for n in ra for k in ('samples', 'tokens', 'loss_tokens')
                  if ra[n][k] != rb[n][k]), None)
    assert first is not None  # other rows of the finetune stream: other token counts
    n, k = first
    assert out[1] == f'accounting: differ: stream {n}: {k} A {ra[n][k]}, B {rb[n][k]}'
    # the weights: the first tensor that differs and its largest difference
    wa = torch.load(a / 'ckpt' / 'latest-rank0.pt', map_location='cpu', weights_only=False)['state']['model']
    wb = torch.load(b / 'ckpt' / 'latest-rank0.pt', map_location='cpu', weights_only=False)['state']['model']
    key = next(k for k in wa if not torch.equal(wa[k], wb[k]))
    diff = (wa[key].double() - wb[key].double()).abs().max().item()
    differing = sum(1 for k in wa if not torch.equal(wa[k], wb[k]))
    assert out[2] == (f'weights:    differ: {key}: max abs diff {diff:.6g} ({differing} of '
                      f'{len(wa)} tensors differ)')


@pytest.mark.slow  # two train.py runs
def test_parts_and_a_given_checkpoint(runs, tmp_path, capsys):
    a, b = runs
    # a copy of a run is equal to it in every part
    copy = tmp_path / 'copy'
    shutil.copytree(a, copy, symlinks=True)
    assert main(['compare', str(a), str(copy)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == 'samples:    equal (4 batches, 16 samples)'
    assert out[1].startswith('accounting: equal (2 streams: arxiv ')
    assert out[2].startswith('weights:    equal (')
    # only the weights, of a named checkpoint: run a's own against itself
    ckpt = str(a / 'ckpt' / 'latest-rank0.pt')
    assert main(['compare', str(a), str(b), '--parts', 'weights', '--checkpoint-b', ckpt]) == 0
    assert capsys.readouterr().out.startswith('weights:    equal (')
    # the same ids but other tokens in batch 2 (a shard rewritten between the runs): named
    lines = (copy / 'samples.jsonl').read_text().splitlines(keepends=True)
    edited = json.loads(lines[2])
    theirs, edited['tokens'] = edited['tokens'], '0123456789abcdef'
    (copy / 'samples.jsonl').write_text(''.join(lines[:2] + [json.dumps(edited) + '\n'] + lines[3:]))
    assert main(['compare', str(a), str(copy), '--parts', 'samples']) == 1
    assert capsys.readouterr().out == (
        f'samples:    differ: batch 2: the same sample ids, different tokens (digest {theirs} (A), '
        f'0123456789abcdef (B)): the rows\' data differed between the runs (a shard rewritten, '
        f'damaged or from another copy)\n')
    # a log written before the digest existed: compared by ids, and the line says so
    (copy / 'samples.jsonl').write_text(''.join(
        json.dumps({k: v for k, v in json.loads(line).items() if k != 'tokens'}) + '\n' for line in lines))
    assert main(['compare', str(a), str(copy), '--parts', 'samples']) == 0
    assert capsys.readouterr().out == \
        'samples:    equal (4 batches, 16 samples; ids only: a log has no token digests)\n'
    # each batch's rows in another order (as on another number of ranks), digests as written:
    # the same training, equal; then one row replaced by a sample of another batch: named
    permuted = [json.loads(line) for line in lines]
    for line in permuted:
        order = list(range(len(line['sample_ids'])))[::-1]
        line['sample_ids'] = [line['sample_ids'][r] for r in order]
        line['stream_ids'] = [line['stream_ids'][r] for r in order]
    (copy / 'samples.jsonl').write_text(''.join(json.dumps(x) + '\n' for x in permuted))
    assert main(['compare', str(a), str(copy), '--parts', 'samples']) == 0
    assert capsys.readouterr().out == 'samples:    equal (4 batches, 16 samples)\n'
    first = json.loads(lines[0])
    outsider = next(i for i in json.loads(lines[1])['sample_ids'] if i not in first['sample_ids'])
    gone = permuted[0]['sample_ids'][1]  # B's row 1 (A's row 2, in A's order)
    permuted[0]['sample_ids'][1] = outsider
    (copy / 'samples.jsonl').write_text(''.join(json.dumps(x) + '\n' for x in permuted))
    assert main(['compare', str(a), str(copy), '--parts', 'samples']) == 1
    names = list(json.loads((a / 'report' / 'stream_accounting.json').read_text())['streams'])
    assert capsys.readouterr().out == (
        f"samples:    differ: batch 0: A sample {gone} ({names[first['stream_ids'][2]]}) at row 2 of 4 (rank "
        f"order) is not in B's batch, B sample {outsider} ({names[permuted[0]['stream_ids'][1]]}) "
        f"at row 1 is not in A's\n")
    # a log one batch shorter: the batch only one run has
    (copy / 'samples.jsonl').write_text(''.join(lines[:-1]))
    assert main(['compare', str(a), str(copy), '--parts', 'samples']) == 1
    assert capsys.readouterr().out == \
        'samples:    differ: A logs 4 batches, B 3: from batch 3 only A has them (4 in all)\n'


def test_bad_input_exits_2_naming_what_is_missing(tmp_path, capsys):
    (tmp_path / 'a').mkdir()
    assert main(['compare', str(tmp_path / 'a'), str(tmp_path / 'nowhere')]) == 2
    assert f'{tmp_path / "nowhere"}: no such run directory' in capsys.readouterr().err
    (tmp_path / 'b').mkdir()
    assert main(['compare', str(tmp_path / 'a'), str(tmp_path / 'b')]) == 2
    err = capsys.readouterr().err
    assert f'{tmp_path / "a"}: expected one sample log' in err and 'found none' in err
    assert main(['compare', str(tmp_path / 'a'), str(tmp_path / 'b'), '--parts', 'weights',
                 '--checkpoint-a', str(tmp_path / 'x.pt')]) == 2
    assert f'{tmp_path / "x.pt"}: no such checkpoint file' in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse: usage errors exit 2 too
        main(['compare', str(tmp_path / 'a'), str(tmp_path / 'b'), '--parts', 'loss'])
    assert e.value.code == 2

"""``inspect`` and ``verify`` on MDS written by another tool: LLM-Foundry token shards (or a folder
of their splits) are told both ways (train in place with a tokenizer, or adopt with it), other MDS
to adopt; each piece of advice, followed as written, works."""

from __future__ import annotations

import json
import shutil

import yaml
from helpers import DEMO_TOKENIZER, SAMPLES

from foundrymix.cli import main


IN_PLACE = ('the tokenizer they were made with (stream key tokenizer: NAME_OR_DIR, or train_loader.tokenizer, '
            'or a top-level tokenizer:)')


def foundry_dir(tmp_path, name='foundry'):
    from foundry_fixtures import concat_tokens, write_foundry_pretrain
    with open(SAMPLES / 'dolly_hhrlhf_sample.jsonl', encoding='utf-8') as f:
        texts = [json.loads(line)['response'] for line in list(f)[:60]]
    out = tmp_path / name
    write_foundry_pretrain(out, concat_tokens(texts, DEMO_TOKENIZER, 64, eos_text='<|endoftext|>'),
                           compression=None)
    return out


def test_foundry_token_shards_are_told_to_train_in_place_or_adopt(tmp_path, capsys):
    d = foundry_dir(tmp_path)
    for command in ('inspect', 'verify'):
        assert main([command, str(d)]) == 2
        err = capsys.readouterr().err
        assert (f"'{d}' holds LLM-Foundry token shards (one tokens column): train them in place by giving "
                f"their stream {IN_PLACE}, or make a foundrymix dataset of them with `foundrymix adopt {d} "
                f"--tokenizer NAME_OR_DIR --out DIR` and use DIR") in err and 'Traceback' not in err, err
    before = sorted(p.name for p in d.iterdir())
    for streams, loader, top in (({'f': {'local': str(d), 'tokenizer': DEMO_TOKENIZER}}, {}, {}),
                                 ({'f': {'local': str(d)}}, {'tokenizer': DEMO_TOKENIZER}, {}),
                                 ({'f': {'local': str(d)}}, {}, {'tokenizer': DEMO_TOKENIZER})):
        plans_in_place(tmp_path, streams, loader, top, capsys)  # as the message says
    assert sorted(p.name for p in d.iterdir()) == before
    assert main(['adopt', str(d), '--tokenizer', DEMO_TOKENIZER, '--out', str(tmp_path / 'adopted')]) == 0
    capsys.readouterr()
    assert main(['verify', str(tmp_path / 'adopted')]) == 0


def plans_in_place(tmp_path, streams, loader, top, capsys):
    cfg = {'max_seq_len': 64, 'global_train_batch_size': 4, 'max_duration': '2ba', **top,
           'train_loader': {'streams': streams, **loader}}
    path = tmp_path / 'c.yaml'
    path.write_text(yaml.safe_dump(cfg))
    assert main(['plan', str(path)]) == 0
    assert 'f: LLM-Foundry token shards read in place' in capsys.readouterr().out


def test_a_folder_of_foundry_token_splits_is_told_to_train_one_in_place_or_adopt(tmp_path, capsys):
    root = tmp_path / 'c4'
    for split in ('train', 'val'):
        foundry_dir(root, split)
    assert main(['inspect', str(root)]) == 2
    err = capsys.readouterr().err
    assert (f"'{root}' is a folder of splits (train, val: LLM-Foundry token shards); train one in place by "
            f"giving its stream local: {root / 'train'} and {IN_PLACE}, or make foundrymix datasets of them "
            f"with `foundrymix adopt {root} --tokenizer NAME_OR_DIR --out DIR` (each split goes to "
            f"DIR/<split>) and give one of those") in err and 'Traceback' not in err, err
    plans_in_place(tmp_path, {'f': {'local': str(root / 'train')}}, {}, {'tokenizer': DEMO_TOKENIZER}, capsys)
    assert main(['adopt', str(root), '--tokenizer', DEMO_TOKENIZER, '--out', str(tmp_path / 'adopted')]) == 0
    capsys.readouterr()
    assert main(['verify', str(tmp_path / 'adopted' / 'val')]) == 0


def test_other_mds_is_told_to_adopt_only(small_streams, tmp_path, capsys):
    d = tmp_path / 'other'
    shutil.copytree(small_streams['arxiv'], d)
    (d / 'foundrymix.json').unlink()
    assert main(['verify', str(d)]) == 2
    err = capsys.readouterr().err
    assert (f"'{d}' holds MDS shards (index.json) written by another tool: make it a foundrymix dataset "
            f"with `foundrymix adopt {d} --out DIR` and use DIR") in err and 'in place' not in err, err

"""``inspect`` and ``verify`` on MDS written by another tool: LLM-Foundry token shards are told
both ways (train in place with a tokenizer, or adopt), other MDS to adopt; the in-place advice,
followed as written, plans."""

from __future__ import annotations

import json
import shutil

import yaml
from helpers import DEMO_TOKENIZER, SAMPLES

from foundrymix.cli import main


def foundry_dir(tmp_path):
    from foundry_fixtures import concat_tokens, write_foundry_pretrain
    with open(SAMPLES / 'dolly_hhrlhf_sample.jsonl', encoding='utf-8') as f:
        texts = [json.loads(line)['response'] for line in list(f)[:60]]
    out = tmp_path / 'foundry'
    write_foundry_pretrain(out, concat_tokens(texts, DEMO_TOKENIZER, 64, eos_text='<|endoftext|>'),
                           compression=None)
    return out


def test_foundry_token_shards_are_told_to_train_in_place_or_adopt(tmp_path, capsys):
    d = foundry_dir(tmp_path)
    for command in ('inspect', 'verify'):
        assert main([command, str(d)]) == 2
        err = capsys.readouterr().err
        assert (f"'{d}' holds LLM-Foundry token shards (one tokens column): train them in place by giving "
                f"their stream the tokenizer they were made with (stream key tokenizer: NAME_OR_DIR, or "
                f"train_loader.tokenizer), or make a foundrymix dataset of them with `foundrymix adopt {d} "
                f"--out DIR`") in err and 'Traceback' not in err, err
    before = sorted(p.name for p in d.iterdir())
    for streams, loader in (({'f': {'local': str(d), 'tokenizer': DEMO_TOKENIZER}}, {}),
                            ({'f': {'local': str(d)}}, {'tokenizer': DEMO_TOKENIZER})):
        cfg = {'max_seq_len': 64, 'global_train_batch_size': 4, 'max_duration': '2ba',
               'train_loader': {'streams': streams, **loader}}
        path = tmp_path / 'c.yaml'
        path.write_text(yaml.safe_dump(cfg))
        assert main(['plan', str(path)]) == 0  # as the message says
        assert 'f: LLM-Foundry token shards read in place' in capsys.readouterr().out
    assert sorted(p.name for p in d.iterdir()) == before


def test_other_mds_is_told_to_adopt_only(small_streams, tmp_path, capsys):
    d = tmp_path / 'other'
    shutil.copytree(small_streams['arxiv'], d)
    (d / 'foundrymix.json').unlink()
    assert main(['verify', str(d)]) == 2
    err = capsys.readouterr().err
    assert (f"'{d}' holds MDS shards (index.json) written by another tool: make it a foundrymix dataset "
            f"with `foundrymix adopt {d} --out DIR` and use DIR") in err and 'in place' not in err, err

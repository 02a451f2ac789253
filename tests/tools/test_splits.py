"""A folder of splits (adopt's output, LLM-Foundry's ``--out_root``) given where one dataset is
expected: ``inspect``, ``verify`` and ``plan`` name the splits inside and what to give; an
``eval_loader`` stream is read by ``plan`` and named under ``eval_loader``."""

from __future__ import annotations

import shutil

import yaml
from helpers import SMALL_SEQ

from foundrymix.cli import main


def splits(tmp_path, small_streams, manifests: bool = True):
    root = tmp_path / 'splits'
    for split, stream in (('train', 'arxiv'), ('val', 'dolly')):
        shutil.copytree(small_streams[stream], root / split)
        if not manifests:
            (root / split / 'foundrymix.json').unlink()
    return root


def test_inspect_and_verify_name_the_splits_and_the_advice_works(small_streams, tmp_path, capsys):
    root = splits(tmp_path, small_streams)
    advice = (f"'{root}' is a folder of splits (train, val: foundrymix datasets); give one of them, "
              f"e.g. {root / 'train'}")
    for command in ('inspect', 'verify'):
        assert main([command, str(root)]) == 2
        err = capsys.readouterr().err
        assert advice in err and 'Traceback' not in err, err
        assert main([command, str(root / 'train')]) == 0  # as the message says
        capsys.readouterr()


def test_a_folder_of_foundry_splits_is_sent_to_adopt(small_streams, tmp_path, capsys):
    root = splits(tmp_path, small_streams, manifests=False)
    assert main(['inspect', str(root)]) == 2
    assert (f"'{root}' is a folder of splits (train, val: MDS written by another tool); make foundrymix "
            f"datasets of them with `foundrymix adopt {root} --out DIR`") in capsys.readouterr().err


def test_plan_reads_the_eval_streams_and_names_them_under_eval_loader(small_streams, tmp_path, capsys):
    root = splits(tmp_path, small_streams)
    cfg = {'max_seq_len': SMALL_SEQ, 'global_train_batch_size': 4, 'max_duration': '2ba',
           'train_loader': {'streams': {'a': {'local': str(small_streams['arxiv'])}}},
           'eval_loader': {'streams': {'e': {'local': str(tmp_path / 'missing')}}}}
    path = tmp_path / 'c.yaml'
    path.write_text(yaml.safe_dump(cfg))
    assert main(['plan', str(path)]) == 2
    err = capsys.readouterr().err
    assert 'eval_loader.streams.e: no foundrymix manifest' in err and 'train_loader' not in err, err
    cfg['eval_loader']['streams']['e']['local'] = str(root)
    path.write_text(yaml.safe_dump(cfg))
    assert main(['plan', str(path)]) == 2
    assert f"eval_loader.streams.e: no foundrymix manifest {root / 'foundrymix.json'} ('{root}' is a folder of " \
           f"splits (train, val" in capsys.readouterr().err
    cfg['eval_loader']['streams']['e']['local'] = str(root / 'val')
    path.write_text(yaml.safe_dump(cfg))
    assert main(['plan', str(path)]) == 0

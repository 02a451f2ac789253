"""``foundrymix export CHECKPOINT --to-hf DIR``: the exported model computes what the run's model did.

Real Composer runs (tiny Llama, 2 batches, CPU, fp32) on the real streams save a
checkpoint; the CLI exports it; ``AutoModelForCausalLM``/``AutoTokenizer.from_pretrained``
load the directory offline and the logits on a mixed batch equal the Composer model's.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import DEMO_TOKENIZER, tiny_run_config

from foundrymix.cli import main as cli


@pytest.fixture(scope='module', params=['causal', 'document'])
def exported(request, small_streams, tmp_path_factory) -> dict:
    """One finished run per attention mode and its export."""
    from foundrymix.loader.mixer import StreamMixer
    from foundrymix.train.builder import build_trainer
    from foundrymix.train.config import TrainConfig

    root = tmp_path_factory.mktemp(f'export-{request.param}')
    loader = {'streams': {n: {'local': str(p)} for n, p in small_streams.items()}, 'shuffle': True,
              'num_workers': 0}
    model = {**tiny_run_config({})['model'], 'attention': request.param}
    cfg = TrainConfig.from_dict(tiny_run_config(
        loader, model=model, global_train_batch_size=8, max_duration='2ba', save_folder=str(root / 'ckpt'),
        save_interval='2ba', callbacks={'stream_accounting': {'out_dir': str(root / 'report'), 'plot': False}}))
    run = build_trainer(cfg)
    run.trainer.fit()
    run.trainer.close()
    assert cli(['export', str(root / 'ckpt' / 'latest-rank0.pt'), '--to-hf', str(root / 'hf')]) == 0
    batch = next(iter(StreamMixer.from_dict(loader).build_dataloader(batch_size=8)))
    return {'root': root, 'hf': root / 'hf', 'model': run.trainer.state.model.eval(), 'batch': batch,
            'attention': request.param}


def test_directory_loads_offline_with_config_weights_and_tokenizer(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foundrymix.tokenizer import load_tokenizer, tokenizer_info

    assert {p.name for p in exported['hf'].iterdir()} >= {'config.json', 'model.safetensors', 'tokenizer.json'}
    model = AutoModelForCausalLM.from_pretrained(exported['hf'], local_files_only=True)
    tok = AutoTokenizer.from_pretrained(exported['hf'], local_files_only=True)
    assert type(model).__name__ == 'LlamaForCausalLM'
    assert model.config.use_cache is True and model.config.hidden_size == 32
    assert tokenizer_info(tok).fingerprint == tokenizer_info(load_tokenizer(DEMO_TOKENIZER)).fingerprint


def test_exported_logits_equal_the_composer_models(exported):
    """Causal: same ``attention_mask``. Document: same restarting ``position_ids``, no mask, no KV cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(exported['hf'], local_files_only=True).eval()
    b = exported['batch']
    with torch.no_grad():
        expected = exported['model'](b).logits
        if exported['attention'] == 'causal':
            got = model(input_ids=b['input_ids'], attention_mask=b['attention_mask']).logits
        else:
            got = model(input_ids=b['input_ids'], position_ids=b['position_ids'], use_cache=False).logits
            plain = model(input_ids=b['input_ids']).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if exported['attention'] == 'document':
        # without position ids the packed documents see each other: other logits
        assert (b['position_ids'][:, 1:] == 0).any()
        assert not torch.allclose(plain, expected, atol=1e-3)


def test_export_refuses_a_non_empty_directory_and_a_checkpoint_without_model_info(exported, tmp_path, capsys):
    ckpt = exported['root'] / 'ckpt' / 'latest-rank0.pt'
    assert cli(['export', str(ckpt), '--to-hf', str(exported['hf'])]) == 2
    assert f'foundrymix export: error: {exported["hf"]}: exists and is not empty (use --overwrite)' in \
        capsys.readouterr().err
    if exported['attention'] == 'document':
        return  # once is enough
    state = torch.load(ckpt, map_location='cpu', weights_only=False)
    del state['state']['callbacks']['ModelInfo']
    torch.save(state, tmp_path / 'old.pt')
    assert cli(['export', str(tmp_path / 'old.pt'), '--to-hf', str(tmp_path / 'out')]) == 2
    assert 'the checkpoint has no ModelInfo record' in capsys.readouterr().err
    assert not (tmp_path / 'out').exists()


def test_export_refuses_a_dataset_directory_even_with_overwrite(exported, small_streams, tmp_path, capsys):
    """--overwrite writes into a directory of model files, never among a dataset's shards."""
    if exported['attention'] == 'document':
        return  # once is enough
    ckpt = exported['root'] / 'ckpt' / 'latest-rank0.pt'
    dataset = tmp_path / 'dolly'
    shutil.copytree(small_streams['dolly'], dataset)
    before = tree(dataset)
    assert cli(['export', str(ckpt), '--to-hf', str(dataset), '--overwrite']) == 2
    assert capsys.readouterr().err == (
        f'foundrymix export: error: {dataset}: holds a dataset (foundrymix.json, index.json, '
        f'{len(before)} entries); export writes model files, never into a dataset (not even with '
        f'--overwrite): choose another --to-hf directory\n')
    assert tree(dataset) == before


def test_export_of_a_checkpoint_folder_takes_its_newest_complete_checkpoint(exported, tmp_path, capsys):
    """The folder holds ba1 (other weights), ba2 (the run's) and a truncated ba3: ba2 is
    exported, and the CLI says so; a folder without checkpoints is refused naming it."""
    if exported['attention'] == 'document':
        return  # once is enough
    from safetensors.torch import load_file

    ckpt = exported['root'] / 'ckpt' / 'latest-rank0.pt'
    folder = tmp_path / 'ckpts'
    folder.mkdir()
    state = torch.load(ckpt, map_location='cpu', weights_only=False)
    torch.save(state, folder / 'ep0-ba2-rank0.pt')
    for name in state['state']['model']:
        state['state']['model'][name] = state['state']['model'][name] + 1
    torch.save(state, folder / 'ep0-ba1-rank0.pt')
    (folder / 'ep0-ba3-rank0.pt').write_bytes((folder / 'ep0-ba2-rank0.pt').read_bytes()[:1000])
    capsys.readouterr()
    assert cli(['export', str(folder), '--to-hf', str(tmp_path / 'hf')]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f'{folder} is a directory: exporting its newest complete checkpoint '
                               f'ep0-ba2-rank0.pt; skipped ep0-ba3-rank0.pt (incomplete: ')
    assert lines[1:] == [f'exported {folder / "ep0-ba2-rank0.pt"} -> {tmp_path / "hf"}']
    assert_same_tensors(load_file(tmp_path / 'hf' / 'model.safetensors'),
                        load_file(exported['hf'] / 'model.safetensors'))

    empty = tmp_path / 'empty'
    empty.mkdir()
    assert cli(['export', str(empty), '--to-hf', str(tmp_path / 'hf2')]) == 2
    assert capsys.readouterr().err == (
        f'foundrymix export: error: {empty}: a directory without checkpoints (no ep<N>-ba<N>-rank0.pt '
        f'or latest-rank0.pt in it); give a checkpoint file or the save_folder of a run\n')
    assert not (tmp_path / 'hf2').exists()


def tree(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def assert_same_tensors(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k

"""Strict ``model:`` keys, and runs that start from a local Hugging Face model directory.

The pretrained model is a tiny Llama trained for a few steps by transformers itself on
rows of the real streams, saved with ``save_pretrained`` beside the bundled tokenizer.
A mixed Composer run started from it must see exactly its weights: the first step's
loss equals the saved model's own loss on that batch, computed independently.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from composer.core import Callback
from helpers import DEMO_TOKENIZER, SMALL_SEQ, spm_tokenizer_path, tiny_run_config

from foundrymix.config import ConfigError
from foundrymix.train.config import TrainConfig
from foundrymix.train.model_spec import ModelSpec

LLAMA = tiny_run_config({})['model']


@pytest.mark.parametrize('model, message', [
    ({'type': 'llama', 'hiden_size': 64}, "model.hiden_size: unknown key for a 'llama' model (transformers llama "
                                          "config); did you mean 'hidden_size'?"),
    ({'type': 'gpt2', 'n_embed': 64}, "model.n_embed: unknown key for a 'gpt2' model (transformers gpt2 config); "
                                      "did you mean 'n_embd'?"),
    ({'type': 'llama', 'atention': 'causal'}, "model.atention: unknown key for a 'llama' model (transformers "
                                              "llama config); did you mean 'attention'?"),
    ({'type': 'lama'}, "model.type: 'lama' is not a transformers model_type (did you mean 'llama'?)"),
    ({'type': 'llama', 'config_overrides': {'num_layers': 2}},
     "model.config_overrides.num_layers: unknown key for a 'llama' model"),
    ({'pretrained': '/nonexistent/model'}, 'model.pretrained: /nonexistent/model: not a local Hugging Face model '
                                           'directory (no config.json; models are never downloaded)'),
    ({'pretrained': True}, 'model.pretrained: true needs pretrained_model_name_or_path'),
])
def test_unknown_or_wrong_model_keys_are_refused(model, message):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict(tiny_run_config({'streams': {'a': {'local': '/x'}}}, model=model,
                                              global_train_batch_size=2, max_duration='1ba'))
    assert message in str(err.value)


def test_valid_keys_include_init_parameters_aliases_and_instance_attributes():
    spec = ModelSpec.from_dict({'type': 'gpt2', 'n_embd': 32, 'hidden_size': 32, 'tie_word_embeddings': False,
                                'config_overrides': {'n_layer': 1}})
    assert spec.config_kwargs == {'n_embd': 32, 'hidden_size': 32, 'tie_word_embeddings': False, 'n_layer': 1}
    assert spec.pretrained is None and spec.model_type == 'gpt2'


@pytest.fixture(scope='module')
def pretrained_dir(tmp_path_factory, small_streams):
    """A tiny Llama trained 5 steps by transformers (AdamW) on arxiv rows, plus the bundled tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from foundrymix.loader.mixer import StreamMixer
    from foundrymix.tokenizer import load_tokenizer

    torch.manual_seed(0)
    kwargs = {k: v for k, v in LLAMA.items() if k != 'type'}
    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=8192, use_cache=False, **kwargs))
    loader = StreamMixer.from_dict({'streams': {'arxiv': {'local': str(small_streams['arxiv'])}},
                                    'num_workers': 0}).build_dataloader(batch_size=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _, batch in zip(range(5), loader):
        model(input_ids=batch['input_ids'], labels=batch['labels']).loss.backward()
        opt.step()
        opt.zero_grad()
    out = tmp_path_factory.mktemp('pretrained') / 'tiny-llama'
    model.save_pretrained(out)
    load_tokenizer(DEMO_TOKENIZER).save_pretrained(out)
    return out


class FirstBatch(Callback):
    """Keeps the first batch the trainer trains on and the loss it computed on it."""

    def __init__(self) -> None:
        self.batch, self.loss = None, None

    def after_loss(self, state, logger) -> None:
        if self.batch is None:
            self.batch = {k: v.clone() for k, v in state.batch.items()}
            self.loss = float(state.loss)


def run_config(streams, model: dict, tmp_path) -> TrainConfig:
    loader = {'streams': {n: {'local': str(p)} for n, p in streams.items()}, 'shuffle': True, 'num_workers': 0}
    return TrainConfig.from_dict(tiny_run_config(
        loader, model=model, global_train_batch_size=8, max_duration='1ba',
        callbacks={'stream_accounting': {'out_dir': str(tmp_path / 'report'), 'plot': False}}))


@pytest.mark.parametrize('spelling', ['pretrained', 'llm-foundry'])
def test_first_step_loss_is_the_pretrained_models_loss(small_streams, pretrained_dir, tmp_path, spelling, capsys):
    from transformers import AutoModelForCausalLM

    from foundrymix.train.builder import build_trainer

    model = ({'pretrained': str(pretrained_dir)} if spelling == 'pretrained' else
             {'pretrained_model_name_or_path': str(pretrained_dir), 'pretrained': True})
    run = build_trainer(run_config(small_streams, {**model, 'attention': 'document'}, tmp_path))
    assert f'model: loaded {len(checkpoint_tensors(pretrained_dir))} tensors from {pretrained_dir} (none left at ' \
           f'init)\n' in capsys.readouterr().out
    first = FirstBatch()
    run.trainer.state.callbacks.append(first)
    run.trainer.fit()
    run.trainer.close()

    saved = AutoModelForCausalLM.from_pretrained(pretrained_dir, local_files_only=True).eval()
    b = first.batch
    with torch.no_grad():
        expected = saved(input_ids=b['input_ids'], position_ids=b['position_ids'], labels=b['labels']).loss
    assert set(b['stream_id'].tolist()) == {0, 1}  # a mixed batch
    assert first.loss == pytest.approx(float(expected), rel=1e-5)


def test_config_only_from_a_directory_is_random_init(small_streams, pretrained_dir, tmp_path):
    from foundrymix.train.builder import build_trainer

    run = build_trainer(run_config(small_streams, {'pretrained_model_name_or_path': str(pretrained_dir),
                                                   'pretrained': False}, tmp_path))
    from transformers import AutoModelForCausalLM

    hf = run.trainer.state.model.model
    ref = AutoModelForCausalLM.from_pretrained(pretrained_dir, local_files_only=True)
    assert hf.config.hidden_size == ref.config.hidden_size
    assert not torch.equal(hf.model.embed_tokens.weight, ref.model.embed_tokens.weight)


def checkpoint_tensors(directory) -> list[str]:
    """The tensor names a saved model directory holds, read with safetensors itself."""
    from safetensors import safe_open
    with safe_open(str(directory / 'model.safetensors'), framework='pt') as f:
        return list(f.keys())


def test_config_overrides_apply_to_the_pretrained_config(small_streams, pretrained_dir, tmp_path, capsys):
    from foundrymix.train.builder import build_trainer

    run = build_trainer(run_config(small_streams, {'pretrained': str(pretrained_dir), 'attention_dropout': 0.25,
                                                   'num_hidden_layers': 2}, tmp_path))
    assert run.trainer.state.model.model.config.attention_dropout == 0.25
    # The second layer is not in the checkpoint: the start line names what stayed at init.
    saved = checkpoint_tensors(pretrained_dir)
    layer0 = sorted(n for n in saved if n.startswith('model.layers.0.'))
    layer1 = sorted(n.replace('layers.0.', 'layers.1.') for n in layer0)
    assert len(layer0) == 9  # 4 attention projections, 3 MLP, 2 norms
    assert f'model: loaded {len(saved)} tensors from {pretrained_dir} (9 left at init: ' \
           f'{", ".join(layer1[:5])} ... and 4 more)\n' in capsys.readouterr().out


def test_streams_of_another_tokenizer_are_refused(small_streams, pretrained_dir, tmp_path):
    from foundrymix.tokenizer import describe_tokenizer, load_tokenizer, tokenizer_info
    from foundrymix.train.builder import build_trainer

    other = tmp_path / 'spm-llama'
    shutil.copytree(pretrained_dir, other)
    for f in other.iterdir():
        if f.name not in ('config.json', 'model.safetensors', 'generation_config.json'):
            f.unlink()
    load_tokenizer(spm_tokenizer_path()).save_pretrained(other)
    with pytest.raises(ConfigError) as err:
        build_trainer(run_config(small_streams, {'pretrained': str(other)}, tmp_path))
    message = str(err.value)
    spm, demo = tokenizer_info(load_tokenizer(str(other))), describe_tokenizer(DEMO_TOKENIZER)
    assert message.startswith(f'model.pretrained: {other} has another tokenizer than the streams '
                              f'({DEMO_TOKENIZER}): vocabulary 32000 vs 8192; ')
    assert message.endswith(f"fingerprint {spm.fingerprint[:12]} vs {demo.fingerprint[:12]} (the directory's "
                            f"vs the streams')")


@pytest.mark.parametrize('vocab, refused', [(8192, False), (8192 + 64, False), (32000, True)])
def test_without_a_tokenizer_the_vocab_size_must_match(small_streams, pretrained_dir, tmp_path, vocab, refused):
    import json

    from foundrymix.train.weights import check_pretrained_tokenizer
    from foundrymix.loader.mixer import StreamMixer

    bare = tmp_path / 'bare'
    bare.mkdir()
    config = json.loads((pretrained_dir / 'config.json').read_text())
    (bare / 'config.json').write_text(json.dumps({**config, 'vocab_size': vocab}))
    streams = StreamMixer.from_dict({'streams': {'a': {'local': str(small_streams['arxiv'])}}}).tokenizer
    spec = ModelSpec.from_dict({'pretrained': str(bare)})
    if not refused:
        check_pretrained_tokenizer(spec, streams)
        return
    with pytest.raises(ConfigError) as err:
        check_pretrained_tokenizer(spec, streams)
    assert str(err.value) == (f"model.pretrained: {bare} (no tokenizer) has vocab_size=32000, the streams' "
                              f"tokenizer {DEMO_TOKENIZER} has 8192 tokens: another vocabulary")


def _yaml(tmp_path, small_streams, model: dict) -> str:
    import yaml
    cfg = tiny_run_config({'streams': {'arxiv': {'local': str(small_streams['arxiv'])}}, 'num_workers': 0},
                          model=model, global_train_batch_size=4, max_duration='1ba',
                          save_folder=str(tmp_path / 'ckpt'),
                          callbacks={'stream_accounting': {'out_dir': str(tmp_path / 'report'), 'plot': False}})
    path = tmp_path / 'run.yaml'
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_a_pretrained_directory_without_weights_is_refused_naming_the_key(small_streams, pretrained_dir,
                                                                         tmp_path, capsys):
    """``plan`` and ``train`` say ``model.pretrained`` holds no weights (was: transformers' OSError
    traceback from train only); the line's way to start from the config alone builds."""
    from foundrymix.cli import main
    from foundrymix.train.builder import build_trainer
    from foundrymix.train.config import load_config

    bare = tmp_path / 'config-only'
    shutil.copytree(pretrained_dir, bare)
    (bare / 'model.safetensors').unlink()
    line = (f'model.pretrained: {bare} holds no weights (none of model.safetensors, model.safetensors.index.json, '
            f'pytorch_model.bin, pytorch_model.bin.index.json): save the model there with save_pretrained, or, '
            f'to start from its config with random weights, write model: {{pretrained_model_name_or_path: '
            f'{bare}, pretrained: false}}')
    path = _yaml(tmp_path, small_streams, {'pretrained': str(bare)})
    for command in ('plan', 'train'):
        assert main([command, path]) == 2
        out, err = capsys.readouterr()
        assert err.splitlines() == [f'foundrymix {command}: error: {line}'], err
    assert not (tmp_path / 'ckpt').exists()
    run = build_trainer(load_config(_yaml(tmp_path, small_streams, {'pretrained_model_name_or_path': str(bare),
                                                                   'pretrained': False})))
    run.claims.release()
    assert run.trainer.state.model.model.config.hidden_size == LLAMA['hidden_size']


@pytest.mark.parametrize('where', ['config.json', 'yaml'])
def test_weights_of_another_size_are_refused_naming_tensor_and_key(small_streams, pretrained_dir, tmp_path,
                                                                   capsys, where):
    """Weights saved with hidden_size 32 under a config.json of 48, or a YAML's model.hidden_size=48:
    one line naming the file, a tensor, both shapes and what to change (was: a RuntimeError about a
    Linear's state_dict). Every tensor of a Llama has a hidden_size dimension: all 12 differ."""
    import json

    from foundrymix.cli import main

    model_dir = tmp_path / 'model'
    shutil.copytree(pretrained_dir, model_dir)
    model: dict = {'pretrained': str(model_dir)}
    if where == 'config.json':
        config = json.loads((model_dir / 'config.json').read_text())
        (model_dir / 'config.json').write_text(json.dumps({**config, 'hidden_size': 48, 'head_dim': 24}))
        source, fix = (f'{model_dir / "config.json"}', 'the config.json beside the weights is not theirs: save '
                       'model and config together (save_pretrained)')
    else:
        model.update(hidden_size=48, head_dim=24)
        source = f'{model_dir / "config.json"} with model.head_dim=24, model.hidden_size=48'
        fix = ('leave out the model keys that change sizes (model.head_dim, model.hidden_size): pretrained '
               'weights keep the sizes they were saved with')
    saved = sorted(checkpoint_tensors(model_dir))
    assert len(saved) == 12
    assert main(['train', _yaml(tmp_path, small_streams, model)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f'foundrymix train: error: model.pretrained: {model_dir / "model.safetensors"} holds {saved[0]} of shape '
        f'[8192, 32], but the model of {source} needs [8192, 48] (also differ: {", ".join(saved[1:4])} ... and 8 '
        f'more); {fix}'], err
    assert not (tmp_path / 'ckpt').exists()

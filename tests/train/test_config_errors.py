"""Issue 21 / 26: every problem of a training YAML in one reading, each with its fix.

A config ported from LLM-Foundry (``mpt-125m.yaml``) took 15 runs of ~25 s each, one
refusal per run, and a top-level refusal named no rename. Now one reading reports every
unknown key, wrong type and bad value, each with the nearest key or LLM-Foundry's rename;
an override's typo is blamed on the override; unit-less intervals and document attention
on a model that ignores ``position_ids`` are refused. Config reading is in-process.
"""

from __future__ import annotations

import textwrap

import pytest
from helpers import SMALL_SEQ, tiny_run_config

from foundrymix.config import ConfigError, ConfigErrors
from foundrymix.train.config import load_config

GOOD = '''
max_seq_len: 32
global_train_batch_size: 4
max_duration: 4ba
model: {type: llama, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1,
        num_attention_heads: 2, num_key_value_heads: 2, max_position_embeddings: 32}
train_loader:
  streams:
    web: {local: /data/web}
    code: {local: /data/code}
'''

#: an LLM-Foundry-style YAML with 14 problems: (start, end) of the line each must give
FOUNDRY = '''
max_seq_len: 32
global_seed: 17
fsdp_config: {sharding_strategy: FULL_SHARD}
console_log_interval: 1ba
icl_tasks: []
tokenizer: {name: EleutherAI/gpt-neox-20b, kwargs: {model_max_length: 32}}
model: {type: llama, hidden_size: 16, num_hiden_layers: 1, num_attention_heads: 2}
train_loader:
  shufle: true
  streams:
    web: {local: /data/web, repaet: 2}
global_train_batch_size: 4
max_duration: 10
eval_interval: 1
save_interval: 500
optimizer: {name: lionw, lr: 1.0e-4}
algorithms: {gradient_clipping: {clipping_type: norm, clipping_threshold: 1.0}, gradient_cliping: {}}
callbacks: {speed_monitr: {}}
'''
FOUNDRY_LINES = [
    ("config: unknown key 'global_seed'; allowed: ", "; LLM-Foundry's global_seed is 'seed' here"),
    ("config: unknown key 'fsdp_config'; allowed: ", "; LLM-Foundry's fsdp_config is 'fsdp' here (same keys)"),
    ("config: unknown key 'console_log_interval'; allowed: ",
     "; LLM-Foundry's console_log_interval is 'log_interval' here"),
    ("config: unknown key 'icl_tasks'; allowed: ", "is not supported; delete it (see docs/train.md)"),
    ("train_loader: unknown key 'shufle'; allowed: ", "; did you mean 'shuffle'?"),
    ("train_loader.streams.web: unknown key 'repaet'; allowed: ", "; did you mean 'repeat'?"),
    ("max_duration: '10' has no unit", "(e.g. 10ep, 10ba, 10sp or 10tok)"),
    ("tokenizer: LLM-Foundry's {name: ..., kwargs: ...} is tokenizer: EleutherAI/gpt-neox-20b here", ""),
    ("model.num_hiden_layers: unknown key for a 'llama' model", "; did you mean 'num_hidden_layers'?"),
    ("optimizer.name: 'lionw' is not one of decoupled_adamw, adamw, decoupled_lionw", ""),
    ("eval_interval: '1' has no unit", "(e.g. 1ba, 1sp, 1tok or 1ep)"),
    ("save_interval: '500' has no unit", "(e.g. 500ba, 500sp, 500tok or 500ep)"),
    ("callbacks: unknown key 'speed_monitr'; allowed: ", "; did you mean 'speed_monitor'?"),
    ("algorithms: unknown key 'gradient_cliping'; allowed: gradient_clipping", "; did you mean 'gradient_clipping'?"),
]


def write(tmp_path, text: str) -> str:
    path = tmp_path / 'run.yaml'
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_every_problem_of_a_foundry_yaml_in_one_reading(tmp_path, capsys):
    """14 problems, 14 lines (in the reader's order: unknown keys, then each section), each with
    the nearest key or LLM-Foundry's rename; the CLI prints the same 14 lines, exit 2."""
    path = write(tmp_path, FOUNDRY)
    with pytest.raises(ConfigErrors) as err:
        load_config(path)
    lines = str(err.value).split('\n')
    assert len(lines) == len(FOUNDRY_LINES) == len(err.value.errors)
    for line, (start, end) in zip(lines, FOUNDRY_LINES):
        assert line.startswith(f'{path}: {start}') and line.endswith(end), line

    from foundrymix.cli import main
    assert main(['plan', path]) == 2
    out, stderr = capsys.readouterr()
    assert out == '' and stderr.splitlines() == [f'foundrymix plan: error: {line}' for line in lines]


@pytest.mark.parametrize('override, message', [
    ('train_loader.strams.web.repeat=2',
     "override 'train_loader.strams.web.repeat=2': train_loader: unknown key 'strams'; allowed: "),
    ('train_loader.streams.wbe.repeat=2',
     "override 'train_loader.streams.wbe.repeat=2': no stream 'wbe' in the YAML (streams: web, code); "
     "did you mean 'web'?"),
    ('optimizer.lrr=1', "override 'optimizer.lrr=1': optimizer: unknown key 'lrr'; allowed: "),
    ('eval_interval=1', "override 'eval_interval=1': eval_interval: '1' has no unit"),
])
def test_an_override_typo_is_blamed_on_the_override(tmp_path, override, message):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, GOOD), [override])
    assert str(err.value).startswith(message)
    if 'unknown key' in message:  # the nearest key, as for a YAML typo
        assert str(err.value).endswith({'strams': "did you mean 'streams'?",
                                        'lrr': "did you mean 'lr'?"}[message.split("'")[-2]])


def test_a_misspelt_stream_of_a_stage_names_the_loaders_streams():
    from helpers import ROOT
    with pytest.raises(ConfigError) as err:
        load_config(str(ROOT / 'yamls' / 'curriculum.yaml'), ['train_loader.stages.0.streams.dolli.repeat=1'])
    assert str(err.value) == ("override 'train_loader.stages.0.streams.dolli.repeat=1': no stream 'dolli' in "
                              "the YAML (streams: arxiv, dolly); did you mean 'dolly'?")


def test_overrides_that_add_or_fix_keys_still_load_and_a_yaml_error_names_the_file(tmp_path):
    path = write(tmp_path, GOOD)
    cfg = load_config(path, ['train_loader.streams.new.local=/data/new', 'train_loader.streams.web.repeat=2'])
    assert list(cfg.train_loader.streams) == ['web', 'code', 'new']
    with pytest.raises(ConfigErrors) as err:  # one from the override, one from the YAML
        load_config(write(tmp_path, GOOD.replace('max_duration: 4ba', 'max_duration: 4')), ['seed=x'])
    assert str(err.value).split('\n') == [
        f"{path}: max_duration: '4' has no unit; give one (e.g. 4ep, 4ba, 4sp or 4tok)",
        "override 'seed=x': seed: expected int, got 'x'"]


@pytest.mark.parametrize('key, value', [
    ('eval_interval', 1), ('save_interval', 500), ('log_interval', 10), ('scheduler', {'t_warmup': 100}),
    ('callbacks', {'stop_at': {'time': 5}}), ('callbacks', {'stream_accounting': {'log_interval': 2}}),
])
def test_unit_less_intervals_are_refused(key, value):
    """Composer reads ``eval_interval: 1`` (the string '1' here) as a time delta, not 1 epoch."""
    from foundrymix.train.config import TrainConfig
    with pytest.raises(ConfigError, match=r"has no unit; give one \(e\.g\. "):
        TrainConfig.from_dict(tiny_run_config({'streams': {'a': {'local': '/d'}}}, global_train_batch_size=2,
                                              max_duration='2ba', **{key: value}))
    ok = {'scheduler': {'t_warmup': '0.05dur'}, 'callbacks': {'stop_at': {'time': '5ba'}}}
    TrainConfig.from_dict(tiny_run_config({'streams': {'a': {'local': '/d'}}}, global_train_batch_size=2,
                                          max_duration='2ba', **{key: ok.get(key, '500ba')}))


MPT = {'type': 'mpt', 'd_model': 32, 'n_heads': 2, 'n_layers': 1, 'max_seq_len': SMALL_SEQ}


def test_document_attention_is_refused_for_a_model_that_ignores_position_ids():
    from foundrymix.train.model_spec import ModelSpec
    with pytest.raises(ConfigError) as err:
        ModelSpec.from_dict({**MPT, 'attention': 'document'})
    assert str(err.value) == (
        "model.attention: document needs a model that builds its mask from position_ids; transformers' "
        "'mpt' ignores them (tokens would attend across documents): write attention: causal, or use a "
        "model type that does (llama, mistral, qwen2, qwen3, gemma, gemma2, phi3, gpt2, gpt_neox, olmo)")
    with pytest.raises(ConfigError, match=r"^model.attn_implementation: 'sdpa': transformers' MPT has only eager"):
        ModelSpec.from_dict({**MPT, 'attention': 'causal', 'attn_implementation': 'sdpa'})
    assert ModelSpec.from_dict({**MPT, 'attention': 'causal'}).attn_implementation == 'eager'


@pytest.mark.parametrize('model_type, kwargs', [
    ('mpt', {'d_model': 32, 'n_heads': 2, 'n_layers': 1}),
    ('llama', {'hidden_size': 32, 'intermediate_size': 64, 'num_hidden_layers': 1, 'num_attention_heads': 2}),
])
def test_the_refusal_agrees_with_the_models(model_type, kwargs):
    """Independent check of :func:`reads_position_ids`: restarting position ids change a real
    model's logits exactly when the predicate says the model reads them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from foundrymix.train.model_spec import ModelSpec, reads_position_ids
    spec = ModelSpec.from_dict({'type': model_type, 'attention': 'causal', **kwargs})
    config = AutoConfig.for_model(model_type, vocab_size=100, **kwargs)
    torch.manual_seed(0)  # the attention implementation as build_hf_model gives it
    model = AutoModelForCausalLM.from_config(config, attn_implementation=spec.attn_implementation or 'sdpa').eval()
    ids = torch.randint(0, 100, (1, 16))
    documents = torch.cat([torch.arange(8), torch.arange(8)])[None]  # two packed documents
    with torch.no_grad():
        changed = not torch.equal(model(input_ids=ids).logits, model(input_ids=ids, position_ids=documents).logits)
    assert changed == reads_position_ids(model_type) == (model_type == 'llama')


def test_gradient_clipping_bounds_the_gradient_norm(small_streams, tmp_path):
    """``algorithms.gradient_clipping`` (LLM-Foundry's spelling) is Composer's algorithm in the
    trainer: the first step's gradients, of global norm over 100x the threshold after the
    backward pass, have a norm of exactly the threshold when the step ends."""
    import torch
    from composer.algorithms import GradientClipping
    from composer.core import Callback

    from foundrymix.train.builder import build_trainer
    from foundrymix.train.config import TrainConfig

    class GradNorm(Callback):
        norms: dict = {}

        def _norm(self, state, when):
            grads = [p.grad for p in state.model.parameters() if p.grad is not None]
            self.norms[when] = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

        def after_backward(self, state, logger):  # one microbatch: the whole step's gradients
            self._norm(state, 'backward')

        def batch_end(self, state, logger):  # after the algorithm and the optimizer step
            self._norm(state, 'step')

    loader = {'streams': {name: {'local': str(path)} for name, path in small_streams.items()}, 'num_workers': 0}
    clip = {'gradient_clipping': {'clipping_type': 'norm', 'clipping_threshold': 1.0e-3}}
    cfg = TrainConfig.from_dict(tiny_run_config(loader, global_train_batch_size=2, max_duration='1ba',
                                                device='cpu', algorithms=clip, callbacks={
                                                    'stream_accounting': {'out_dir': str(tmp_path), 'plot': False}}))
    run = build_trainer(cfg)
    try:
        algorithms = [a for a in run.trainer.state.algorithms if isinstance(a, GradientClipping)]
        assert [(a.clipping_type, a.clipping_threshold) for a in algorithms] == [('norm', 1.0e-3)]
        probe = GradNorm()
        run.trainer.state.callbacks.append(probe)
        run.trainer.fit()
    finally:
        run.trainer.close()
        run.claims.release()
    assert probe.norms['backward'] > 100 * 1.0e-3
    assert probe.norms['step'] == pytest.approx(1.0e-3, rel=1e-4)


def test_eval_first_evaluates_once_before_the_first_batch(small_streams, capsys, tmp_path):
    """LLM-Foundry's ``eval_first``: one evaluation before training, besides Composer's own at
    the end of fit (an eval_interval longer than the run)."""
    from foundrymix.train.builder import train
    from foundrymix.train.config import TrainConfig

    loader = {'streams': {'arxiv': {'local': str(small_streams['arxiv'])}}, 'num_workers': 0}
    evals = {}
    for first in (False, True):
        cfg = TrainConfig.from_dict(tiny_run_config(
            loader, global_train_batch_size=2, max_duration='1ba', device='cpu', eval_interval='1000ba',
            eval_subset_num_batches=1, eval_loader={**loader, 'shuffle': False}, eval_first=first,
            progress_bar=False, loggers={'console': {}},
            callbacks={'stream_accounting': {'out_dir': str(tmp_path / str(first)), 'plot': False}}))
        capsys.readouterr()
        train(cfg)
        evals[first] = capsys.readouterr().out.count('metrics/eval/LanguageCrossEntropy')
    assert evals == {False: 1, True: 2}


def test_plan_reads_trainer_keys_without_a_model_as_train_does(tmp_path, capsys):
    """A YAML with trainer keys but no model is no data-only YAML: ``plan`` reads every key as
    ``train`` does (the same refusal, blamed on the override), only the model may be absent."""
    from foundrymix.cli import main
    no_model = '\n'.join(ln for ln in GOOD.splitlines() if not ln.startswith(('model:', '        num_')))
    path = write(tmp_path, no_model + '\noptimizer: {lr: 0.01}\n')
    for override, message in [('optimizer.lrr=1', "optimizer: unknown key 'lrr'; allowed: name, lr, "),
                              ('scheduler.t_warmup=5', "scheduler.t_warmup: '5' has no unit"),
                              ('global_seed=3', "config: unknown key 'global_seed'; allowed: train_loader, ")]:
        assert main(['plan', path, override]) == 2
        planned = capsys.readouterr().err.splitlines()
        assert planned[0].startswith(f'foundrymix plan: error: override {override!r}: {message}')
        with pytest.raises(ConfigError) as err:
            load_config(path, [override])
        lines = str(err.value).split('\n')
        lines.remove(f"{path}: config: missing required key 'model'")  # the one difference
        assert lines == [ln.removeprefix('foundrymix plan: error: ') for ln in planned]

"""`foundrymix migrate`: LLM-Foundry's mpt-125m.yaml (13 refusals in one reading) becomes a YAML the
config reader accepts; every change and every setting without equivalent is listed; the input
is only read and --out never replaces a file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import DEMO_TOKENIZER, FOUNDRY_DIR, SMALL_SEQ, tiny_dbrx

from foundrymix.cli import main
from foundrymix.config import ConfigError, ConfigErrors
from foundrymix.train.config import load_config

#: LLM-Foundry's scripts/train/yamls/pretrain/mpt-125m.yaml (its old top-level variables style)
FOUNDRY = """
data_local: ./my-copy-c4
data_remote:
max_seq_len: 2048
global_seed: 17
run_name:
model:
  name: mpt_causal_lm
  init_device: meta
  d_model: 768
  n_heads: 12
  n_layers: 12
  expansion_ratio: 4
  max_seq_len: ${max_seq_len}
  vocab_size: 50368
  attn_config:
    attn_impl: flash
tokenizer:
  name: EleutherAI/gpt-neox-20b
  kwargs:
    model_max_length: ${max_seq_len}
train_loader:
  name: text
  dataset:
    local: ${data_local}
    remote: ${data_remote}
    split: train
    shuffle: true
    max_seq_len: ${max_seq_len}
    shuffle_seed: ${global_seed}
  drop_last: true
  num_workers: 8
eval_loader:
  name: text
  dataset:
    local: ${data_local}
    remote: ${data_remote}
    split: val
    shuffle: false
    max_seq_len: ${max_seq_len}
    shuffle_seed: ${global_seed}
  drop_last: false
  num_workers: 8
scheduler:
  name: cosine_with_warmup
  t_warmup: 100ba
  alpha_f: 0.1
optimizer:
  name: decoupled_adamw
  lr: 6.0e-4
  betas: [0.9, 0.95]
  eps: 1.0e-08
  weight_decay: 0.0
algorithms:
  gradient_clipping:
    clipping_type: norm
    clipping_threshold: 1.0
max_duration: 4800ba
eval_interval: 500ba
eval_first: false
eval_subset_num_batches: -1
global_train_batch_size: 256
seed: ${global_seed}
device_eval_batch_size: 16
device_train_microbatch_size: 16
precision: amp_bf16
fsdp_config:
  sharding_strategy: FULL_SHARD
  mixed_precision: PURE
  activation_checkpointing: false
  activation_checkpointing_reentrant: false
  activation_cpu_offload: false
  limit_all_gathers: true
progress_bar: false
log_to_console: true
console_log_interval: 1ba
callbacks:
  speed_monitor:
    window_size: 10
  lr_monitor: {}
  memory_monitor: {}
  runtime_estimator: {}
"""

FSDP_LINE = ('changed: fsdp_config -> fsdp (FSDP runs on GPUs here: a CPU run is refused until fsdp is left out; '
             'LLM-Foundry dropped it with a warning on one rank)')
RUN_NAME_LINE = ("changed: run_name: {was} -> ${{oc.env:RUN_NAME,{name}}} (LLM-Foundry: $RUN_NAME, else a "
                 "generated name; here $RUN_NAME, else {name}: the run's report and {{run_name}} in save_folder follow "
                 "it, so give each run its own)")
ATTN_LINE = ("changed: model.attn_config.attn_impl: {impl} -> eager: transformers' MPT computes eager attention "
             "(the same values, slower and more memory than {impl}); for sdpa or flash_attention_2 use a model type "
             "that has them (llama, gpt2, ...)")
REPORT = [
    'kept: max_seq_len, scheduler, optimizer, algorithms, max_duration, eval_interval, eval_first, '
    'eval_subset_num_batches, global_train_batch_size, seed, device_eval_batch_size, device_train_microbatch_size, '
    'precision, progress_bar, callbacks (the same keys and meaning here)',
    'kept: model.d_model, model.n_heads, model.n_layers, model.expansion_ratio, model.max_seq_len, model.vocab_size, '
    'train_loader.drop_last, train_loader.num_workers, eval_loader.drop_last, eval_loader.num_workers (the same keys '
    'and meaning here)',
    'changed: data_local: moved under variables (${data_local} -> ${variables.data_local})',
    'changed: data_remote: moved under variables (${data_remote} -> ${variables.data_remote})',
    'changed: global_seed: moved under variables (${global_seed} -> ${variables.global_seed})',
    FSDP_LINE,
    'changed: console_log_interval -> log_interval',
    RUN_NAME_LINE.format(was='empty', name='mpt-125m'),
    'changed: tokenizer: {name: EleutherAI/gpt-neox-20b, ...} -> tokenizer: EleutherAI/gpt-neox-20b',
    'changed: train_loader.dataset.{local, remote, split} -> train_loader.streams.train',
    'changed: train_loader.dataset.shuffle -> train_loader.shuffle',
    'changed: train_loader.dataset.shuffle_seed -> train_loader.shuffle_seed',
    'changed: eval_loader.dataset.{local, remote, split} -> eval_loader.streams.eval',
    'changed: eval_loader.dataset.shuffle -> eval_loader.shuffle',
    'changed: eval_loader.dataset.shuffle_seed -> eval_loader.shuffle_seed',
    'changed: model.name: mpt_causal_lm -> model.type: mpt',
    "changed: model.attention: causal (transformers' MPT ignores position_ids, so document attention is refused)",
    ATTN_LINE.format(impl='flash'),
    "removed: log_to_console: LLM-Foundry's log_to_console: the console logger is on unless loggers leaves it "
    "out (loggers: {console: {}})",
    'removed: tokenizer.kwargs (model_max_length): no equivalent (max_seq_len and the streams decide)',
    'removed: train_loader.name: text (its LLM-Foundry token shards are read in place, with the top-level '
    'tokenizer; `foundrymix adopt` makes a converted copy)',
    'removed: train_loader.dataset.max_seq_len: the top-level max_seq_len says it',
    'removed: eval_loader.name: text (its LLM-Foundry token shards are read in place, with the top-level '
    'tokenizer; `foundrymix adopt` makes a converted copy)',
    'removed: eval_loader.dataset.max_seq_len: the top-level max_seq_len says it',
    'removed: model.init_device: meta: no equivalent (fsdp builds the model)',
    'complete: every key is kept, changed or removed as listed',
    # a trial's evaluation: one batch, once, at the end (not the whole eval set, as -1 says)
    'for a CPU trial add: fsdp=null precision=fp32 eval_subset_num_batches=1 eval_interval=4800ba',
]


def test_migrate_turns_a_foundry_yaml_into_one_that_reads(tmp_path, capsys):
    src, out = tmp_path / 'mpt-125m.yaml', tmp_path / 'new.yaml'
    src.write_text(FOUNDRY)
    with pytest.raises(ConfigErrors) as err:  # as it is: every refusal at once
        load_config(str(src))
    assert len(err.value.errors) == 13

    assert main(['migrate', str(src), '--out', str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == REPORT + [
        f'wrote {out}; check it with: foundrymix plan {out}']
    cfg = load_config(str(out))
    assert {n: (s.local, s.remote, s.split) for n, s in cfg.train_loader.streams.items()} == {
        'train': ('./my-copy-c4', None, 'train')}
    assert cfg.eval_loader.streams['eval'].split == 'val' and cfg.eval_loader.drop_last is False
    assert (cfg.seed, cfg.train_loader.shuffle_seed, cfg.log_interval, cfg.tokenizer) == (
        17, 17, '1ba', 'EleutherAI/gpt-neox-20b')
    assert (cfg.fsdp.sharding_strategy, cfg.fsdp.mixed_precision) == ('FULL_SHARD', 'PURE')
    assert (cfg.model.model_type, cfg.model.attention, cfg.model.config_kwargs['max_seq_len']) == ('mpt', 'causal', 2048)
    assert cfg.algorithms['gradient_clipping'].clipping_threshold == 1.0

    written = out.read_bytes()
    assert main(['migrate', str(src), '--out', str(out)]) == 2  # never replaces a file
    assert 'exists' in capsys.readouterr().err
    assert out.read_bytes() == written and src.read_text() == FOUNDRY


def test_migrate_drops_streamings_replaced_knobs(tmp_path, capsys):
    """Streaming's sampler and download knobs (in the dataset or the loader) are removed, each with
    what replaced it, and the migrated loader reads; the reader alone refuses each of them."""
    src, out = tmp_path / 'old.yaml', tmp_path / 'new.yaml'
    src.write_text(FOUNDRY.replace('    shuffle_seed: ${global_seed}\n  drop_last: true\n',
                                   '    shuffle_seed: ${global_seed}\n    shuffle_algo: py1e\n'
                                   '    predownload: 8\n  drop_last: true\n  num_canonical_nodes: 2\n', 1))
    with pytest.raises(ConfigErrors) as err:
        load_config(str(src))
    assert "train_loader.num_canonical_nodes: streaming's sampler knob" in str(err.value)
    assert main(['migrate', str(src), '--out', str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if 'knob' in line] == [
        "removed: train_loader.shuffle_algo: py1e: streaming's sampler knob, replaced by foundrymix's own order "
        "(each stream is shuffled a window of shards at a time (shuffle_block_size rows))",
        "removed: train_loader.predownload: 8: streaming's download knob, replaced by foundrymix's own order "
        "(the order is known: each reader fetches the shards of its next batches ahead, in a thread)",
        "removed: train_loader.num_canonical_nodes: 2: streaming's sampler knob, replaced by foundrymix's own "
        "order (ranks slice one global order, the same on any topology)"]
    text = out.read_text()
    assert not any(k in text for k in ('shuffle_algo', 'predownload', 'num_canonical_nodes'))
    assert load_config(str(out)).train_loader.shuffle_seed == 17


def test_migrate_lists_what_it_cannot_rewrite(tmp_path, capsys):
    src = tmp_path / 'f.yaml'
    src.write_text('max_seq_len: 64\neval_interval: 1\nsave_interval: 0.5\noptimizer: {name: decoupled_lionw}\n'
                   'icl_tasks: []\ncallbacks: {hf_checkpointer: {}}\n')
    assert main(['migrate', str(src)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[:10] == [
        '# kept: max_seq_len, optimizer (the same keys and meaning here)',
        '# ' + RUN_NAME_LINE.format(was='absent', name='f'),
        '# changed: eval_interval: 1 -> 1ep (an int is epochs in Composer, which LLM-Foundry hands it to)',
        "# removed: icl_tasks: LLM-Foundry's in-context-learning evaluation (icl_tasks) is not supported",
        '# removed: callbacks.hf_checkpointer: no equivalent (here: stream_accounting, sample_log, stop_at, '
        'speed_monitor, lr_monitor, memory_monitor, runtime_estimator)',
        '# to do: save_interval: 0.5 has no unit: give one (e.g. 0.5ep; Composer reads an int as epochs)',
        # what the config reader would refuse in the migrated YAML is to do now, not a surprise later
        "# to do: config: missing required key 'train_loader' (the migrated YAML is refused so)",
        "# to do: config: missing required key 'global_train_batch_size' (the migrated YAML is refused so)",
        "# to do: config: missing required key 'model' (the migrated YAML is refused so)",
        '# to do: 4 line(s) above before it runs']
    assert 'name: decoupled_lionw' in out  # kept: foundrymix has it (tests/train/test_optim.py)


def _report(name: str, tmp_path, capsys) -> tuple[list[str], Path]:
    out = tmp_path / 'new.yaml'
    assert main(['migrate', str(FOUNDRY_DIR / f'{name}.yaml'), '--out', str(out)]) == 0
    return capsys.readouterr().out.splitlines(), out


#: the lines every one of the shipped YAMLs gets (they share these sections)
COMMON = ['changed: console_log_interval -> log_interval',
          "removed: log_to_console: LLM-Foundry's log_to_console: the console logger is on unless loggers leaves it "
          "out (loggers: {console: {}})"]
KWARGS = 'removed: tokenizer.kwargs (model_max_length): no equivalent (max_seq_len and the streams decide)'
MPT_LINES = ['changed: model.name: mpt_causal_lm -> model.type: mpt',
             "changed: model.attention: causal (transformers' MPT ignores position_ids, so document attention is "
             "refused)"]
HF_TODO = ("to do: {loader}.dataset (hf_name: json, hf_kwargs: {{'data_dir': '/path/to/data/dir/'}}, preprocessing_fn: "
           "my.import.path:my_preprocessing_fn): a Hugging Face dataset read at training time; here data is converted "
           "once: foundrymix convert finetune /path/to/data/dir/ --preprocess my.import.path:my_preprocessing_fn "
           "--out DIR (the {split} split's files), then set {loader}.streams.{stream}.local: DIR")
HUB_TODO = ('to do: model.pretrained_model_name_or_path: {name}: give a local Hugging Face model directory (models '
            'are never downloaded; e.g. save_pretrained() it once)')
AUTH = ("removed: model.use_auth_token: true: LLM-Foundry's Hugging Face Hub token has no equivalent: models are never "
        "downloaded here, a local model directory needs no token")
CPU = 'for a CPU trial add: fsdp=null precision=fp32'
EVAL = ' eval_subset_num_batches=1 eval_interval={end}'  # a trial's evaluation: one batch, at its end
PRETRAINED = ('kept: model.pretrained: {v}: ' + "{what}, as in LLM-Foundry")
LOADS = PRETRAINED.format(v='true', what='load the weights of the model directory')
CONFIG_ONLY = PRETRAINED.format(v='false', what="the model directory's config only, the weights initialised at random")
TYPE_TODO = ("to do: {keys}: checked against the model's type once model.pretrained_model_name_or_path is a local "
             "directory (`foundrymix plan` names what it refuses: attention: causal for a type that ignores "
             "position_ids, attn_implementation: eager for one without sdpa, a key its config lacks)")
# the loader starts workers per span: a persistent_workers: true would be a promise not kept
PERSISTENT = ('removed: {loader}.persistent_workers: true: each span of batches (an epoch, a stage, an '
              'evaluation) is read by workers of its own, forked when it starts')
COMPLETE = 'complete: every key is kept, changed or removed as listed'
#: per shipped YAML: (lines it must print, besides COMMON; how many lines in all)
SHIPPED = {
    'mpt-125m': ([FSDP_LINE, KWARGS, RUN_NAME_LINE.format(was='${variables.run_name} (empty)', name='mpt-125m'),
                  *MPT_LINES, ATTN_LINE.format(impl='flash'),
                  'changed: train_loader.dataset.{local, remote, split} -> train_loader.streams.train',
                  'changed: eval_loader.dataset.{local, remote, split} -> eval_loader.streams.eval',
                  'removed: model.init_device: meta: no equivalent (fsdp builds the model)', COMPLETE,
                  CPU + EVAL.format(end='4800ba')], 24),
    'mpt-small-cpu': ([FSDP_LINE, KWARGS, *MPT_LINES,
                       "removed: model.loss_fn: torch_crossentropy: no equivalent (the loss is transformers' "
                       "cross-entropy on the labels)", COMPLETE, 'for a CPU trial add: fsdp=null'], 23),
    'gpt2-arc-easy-cpu-streaming-dataset': ([
        KWARGS, RUN_NAME_LINE.format(was='${variables.run_name} (empty)', name='gpt2-arc-easy-cpu-streaming-dataset'),
        'changed: train_loader.dataset.streams -> train_loader.streams',
        'changed: eval_interval: 1 -> 1ep (an int is epochs in Composer, which LLM-Foundry hands it to)',
        'removed: model.name: hf_causal_lm (pretrained_model_name_or_path says the model)',
        'removed: train_loader.dataset.decoder_only_format: true: no equivalent (finetune streams are decoder-only: '
        'prompt then response, loss on the response)',
        HUB_TODO.format(name='gpt2'), LOADS, TYPE_TODO.format(keys='model.attention'),
        'to do: 2 line(s) above before it runs'], 18),
    '1b_local_data_sft': ([
        FSDP_LINE, KWARGS, RUN_NAME_LINE.format(was='empty', name='1b_local_data_sft'), *MPT_LINES,
        ATTN_LINE.format(impl='flash'),
        'removed: dataset: a block the YAML merges into train_loader.dataset and eval_loader.dataset '
        '(<<: *anchor), migrated there',
        'removed: train_loader.dataset.allow_pad_trimming: false: no equivalent (finetune rows are packed full by '
        '`foundrymix convert finetune`; no padding to trim)',
        HF_TODO.format(loader='train_loader', split='train', stream='train'),
        HF_TODO.format(loader='eval_loader', split='validation', stream='eval'),
        PERSISTENT.format(loader='train_loader'), PERSISTENT.format(loader='eval_loader'),
        'to do: 2 line(s) above before it runs', CPU + EVAL.format(end='1ep')], 25),
    'gpt2-small': ([
        FSDP_LINE, KWARGS, RUN_NAME_LINE.format(was='empty', name='gpt2-small'),
        'changed: tokenizer_name: moved under variables (${tokenizer_name} -> ${variables.tokenizer_name})',
        HUB_TODO.format(name='gpt2'), CONFIG_ONLY,
        TYPE_TODO.format(keys='model.attention, model.config_overrides.n_positions'),
        'to do: 2 line(s) above before it runs', CPU + EVAL.format(end='33696ba')], 28),
    '7b_dolly_sft': ([
        FSDP_LINE, KWARGS, RUN_NAME_LINE.format(was='empty', name='7b_dolly_sft'), *MPT_LINES,
        ATTN_LINE.format(impl='flash'),
        "to do: train_loader.dataset (hf_name: HuggingFaceH4/databricks_dolly_15k): a Hugging Face dataset read at "
        "training time; here data is converted once: foundrymix convert finetune the "
        "HuggingFaceH4/databricks_dolly_15k files --out DIR (the train split's files), then set "
        "train_loader.streams.train.local: DIR", PERSISTENT.format(loader='train_loader'),
        'to do: 1 line(s) above before it runs', CPU], 23),
    'llama-3-8b_domain_adapt': ([
        FSDP_LINE, KWARGS, RUN_NAME_LINE.format(was='empty', name='llama-3-8b_domain_adapt'), AUTH,
        'removed: load_weights_only: true: no load_path, so no weights to load (LLM-Foundry ignored it)',
        HUB_TODO.format(name='meta-llama/Meta-Llama-3-8B'), LOADS,
        TYPE_TODO.format(keys='model.attention, model.config_overrides.max_seq_len, '
                              'model.config_overrides.attn_config'),
        'to do: 2 line(s) above before it runs', CPU + EVAL.format(end='3195ba')], 26),
    'dbrx-lora-ft': ([
        FSDP_LINE, AUTH, RUN_NAME_LINE.format(was='empty', name='dbrx-lora-ft'),
        'removed: tokenizer.kwargs (model_max_length, trust_remote_code): no equivalent (max_seq_len and the streams '
        'decide)',
        'changed: model.use_flash_attention_2: true -> model.attn_implementation: flash_attention_2 (GPU only, with '
        'flash-attn installed)',
        'removed: model.init_device: mixed: no equivalent (fsdp builds the model)',
        'removed: train_loader.dataset.eos_token_id: 0: no equivalent (the tokenizer\'s EOS, recorded in each '
        'stream\'s manifest, ends the documents)',
        "kept: model.peft_config (r: 64, peft_type: LORA, task_type: CAUSAL_LM, lora_alpha: 128, lora_dropout: 0.05, "
        "target_modules: ['Wqkv']): LoRA through the peft library, as in LLM-Foundry: the base weights are frozen, "
        "the adapter trains; target_modules are checked against the model's layers at start; export writes the "
        "merged model, or with --adapter the adapter alone",
        HUB_TODO.format(name='databricks/dbrx-instruct'), LOADS, TYPE_TODO.format(keys='model.attention'),
        'to do: 4 line(s) above before it runs',
        PERSISTENT.format(loader='train_loader'), PERSISTENT.format(loader='eval_loader'),
        'for a CPU trial add: fsdp=null precision=fp32 model.attn_implementation=sdpa' + EVAL.format(end='2ep')], 38),
    'gpt-neo-125m': ([
        FSDP_LINE, KWARGS, RUN_NAME_LINE.format(was='${variables.run_name} (empty)', name='gpt-neo-125m'),
        HUB_TODO.format(name='EleutherAI/gpt-neo-125M'), CONFIG_ONLY,
        TYPE_TODO.format(keys='model.attention, model.config_overrides.max_position_embeddings'),
        'to do: 2 line(s) above before it runs', CPU + EVAL.format(end='4800ba')], 24),
    'opt-3b': ([
        FSDP_LINE, KWARGS, RUN_NAME_LINE.format(was='${variables.run_name} (empty)', name='opt-3b'),
        HUB_TODO.format(name='facebook/opt-2.7b'), LOADS, TYPE_TODO.format(keys='model.attention'),
        'to do: 2 line(s) above before it runs', CPU + EVAL.format(end='4800ba')], 24),
    'testing-moe': ([
        FSDP_LINE, KWARGS, *MPT_LINES,
        "removed: model.loss_fn: torch_crossentropy: no equivalent (the loss is transformers' cross-entropy on the "
        "labels)",
        # a mixture of experts would silently become a dense MLP: kept, so plan refuses it until deleted
        "to do: model.ffn_config: {'ffn_type': 'mb_dmoe', 'memory_optimized_mlp': True, 'mlp_impl': 'grouped', "
        "'moe_lbl_in_fp32': False, 'moe_loss_weight': 0.01, 'moe_num_experts': 4, 'moe_top_k': 2, "
        "'moe_world_size': 1, 'uniform_expert_assignment': False}: LLM-Foundry MPT's ffn_config has no equivalent: "
        "transformers' MPT has one MLP (d_model x expansion_ratio, GELU: LLM-Foundry's default ffn_type mptmlp); "
        "kept, so plan and train refuse the YAML: delete model.ffn_config to accept a dense MLP instead of its "
        "experts (a different model), or keep this run on LLM-Foundry",
        'to do: 1 line(s) above before it runs', CPU + EVAL.format(end='200ba')], 25),
}


@pytest.mark.parametrize('name', list(SHIPPED))
def test_migrate_reports_the_shipped_foundry_yamls(name, tmp_path, capsys):
    """Each of LLM-Foundry's shipped YAMLs: the important lines exactly, every line a kept, changed,
    removed (with its reason) or to do, the to-do count and the CPU trial's overrides last; the
    migrated YAML reads when migrate calls it complete."""
    before = (FOUNDRY_DIR / f'{name}.yaml').read_bytes()
    lines, out = _report(name, tmp_path, capsys)
    expected, count = SHIPPED[name]
    for line in COMMON + expected:
        assert line in lines, line
    assert len(lines) == count + 1 and lines[-1] == f'wrote {out}; check it with: foundrymix plan {out}'
    cpu = [line for line in lines if line.startswith('for a CPU trial add: ')]
    body = lines[:len(lines) - 2 - len(cpu)]  # then the status line, the CPU overrides, 'wrote'
    assert all(line.split(': ')[0] in ('kept', 'changed', 'removed', 'to do') for line in body)
    assert all(': ' in line.split(': ', 1)[1] or ' -> ' in line or line.startswith('kept: ') for line in body)
    todo = [line for line in body if line.startswith('to do: ')]
    status = lines[len(body)]
    if status == COMPLETE:
        assert not todo
        load_config(str(out))  # reads as it is
    else:
        assert todo and status == f'to do: {len(todo)} line(s) above before it runs'
    assert (FOUNDRY_DIR / f'{name}.yaml').read_bytes() == before  # only read


def _paths(node, prefix=''):
    """The key path of every value of a YAML mapping (nested mappings walked, an empty one is a
    value; lists are values)."""
    for key, value in node.items():
        path = f'{prefix}{key}'
        if isinstance(value, dict) and value:
            yield from _paths(value, path + '.')
        else:
            yield path


@pytest.mark.parametrize('name', list(SHIPPED))
def test_migrate_accounts_for_every_key(name, tmp_path, capsys):
    """Every key path of the input YAML (read here with yaml, not by migrate) is named in the
    report -- itself or a section that holds it -- as kept, changed, removed or to do."""
    import re

    import yaml
    data = yaml.safe_load((FOUNDRY_DIR / f'{name}.yaml').read_text())
    lines, _ = _report(name, tmp_path, capsys)
    named = set()  # the keys each line is about: what it starts with, never a word further on
    for line in lines[:-1]:
        kind, _, text = line.partition(': ')
        subject = re.split(r': | -> | \((?!the same)', text)[0] if kind != 'kept' or ' (the same' not in text \
            else text.split(' (')[0]
        for path, group in re.findall(r'([\w.]+?)\.?\{([\w, ]+)\}', subject):  # dataset.{local, split}
            named.update(f'{path}.{k}' for k in group.split(', '))
        named.update(subject.split(', '))
    missing = [p for p in _paths(data) if not any('.'.join(p.split('.')[:i]) in named
                                                   for i in range(1, p.count('.') + 2))]
    assert missing == []


def test_migrated_mpt_small_cpu_reads(tmp_path, capsys):
    """LLM-Foundry's pretrain/mpt-small-cpu.yaml (the shipped file) sets ``model.loss_fn:
    torch_crossentropy`` and ``run_name: ${variables.run_name}`` with that variable set: the
    migrated YAML must read, not stop at either."""
    lines, out = _report('mpt-small-cpu', tmp_path, capsys)
    assert ("removed: model.loss_fn: torch_crossentropy: no equivalent (the loss is transformers' "
            "cross-entropy on the labels)") in lines
    assert not [line for line in lines if line.startswith('to do')]
    cfg = load_config(str(out))
    assert (cfg.model.model_type, cfg.run_name, cfg.eval_interval, cfg.log_interval) == (
        'mpt', 'mpt_causal_lm_cpu', '5ba', '1ba')


#: Overrides that only make each migrated YAML fit this machine and the bundled data, never
#: fix a migration: the data paths (their files do not exist here), the tokenizer (gpt-neox-20b
#: and gpt2 are not bundled; the streams were made with the demo one), the row length of the
#: small streams, a model small enough for a CPU (same model type, fewer/narrower layers),
#: a few batches of a few rows (one of eval), no loader worker processes, fp32 and no fsdp (this is a CPU:
#: FSDP needs GPUs, migrate says so) and a local pretrained model directory for gpt2 (migrate
#: lists that one as a to do).
SCALE = ['fsdp=null', 'train_loader.num_workers=0', 'global_train_batch_size=4', 'device_train_microbatch_size=2',
         'device_eval_batch_size=2', 'max_duration=2ba', 'eval_subset_num_batches=1', 'precision=fp32',
         f'tokenizer={DEMO_TOKENIZER}', f'variables.max_seq_len={SMALL_SEQ}']
MPT = ['model.d_model=16', 'model.n_heads=2', 'model.n_layers=1', 'model.expansion_ratio=2', 'model.vocab_size=8192']


def _tiny_gpt2(path: Path) -> Path:
    """A 1-layer GPT-2 saved by transformers itself, the bundled tokenizer beside it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from foundrymix.tokenizer import load_tokenizer
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=8192, n_positions=SMALL_SEQ)
                    ).save_pretrained(path)
    load_tokenizer(DEMO_TOKENIZER).save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize('name', ['mpt-125m', 'mpt-small-cpu', 'gpt2-arc-easy-cpu-streaming-dataset',
                                  '1b_local_data_sft'])
def test_each_migrated_foundry_yaml_trains(name, small_streams, tmp_path, capsys):
    """Migrated, each of the four shipped Foundry YAMLs trains a few batches on CPU (real run,
    in process) with only the data/scale overrides above; to-do lines are exactly what the
    overrides had to supply."""
    pytest.importorskip('composer')  # it trains: the composer extra (scripts/test_core.sh has none)
    from foundrymix.train.builder import train

    out = tmp_path / 'new.yaml'
    assert main(['migrate', str(FOUNDRY_DIR / f'{name}.yaml'), '--out', str(out)]) == 0
    todo = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith('to do:') and not line.endswith(' line(s) above before it runs')]
    data = tmp_path / 'data'
    finetune = name.startswith(('gpt2', '1b'))  # Foundry's finetune/ YAMLs
    stream = small_streams['dolly' if finetune else 'arxiv']
    for split in ('train', 'val', 'validation'):
        shutil.copytree(stream, data / split)
    overrides = SCALE + [f'save_folder={tmp_path / "ckpt"}'] + (
        [] if name.startswith('gpt2') else ['eval_loader.num_workers=0'])
    if name.startswith('mpt'):
        overrides += MPT + [f'variables.data_local={data}']
    elif name.startswith('gpt2'):
        overrides += [f'variables.data_local={data}',
                      f'model.pretrained_model_name_or_path={_tiny_gpt2(tmp_path / "gpt2")}']
        assert todo == [HUB_TODO.format(name='gpt2'), TYPE_TODO.format(keys='model.attention')]
    else:  # an HF json dataset with a preprocessing function: converted first, here already
        overrides += MPT + [f'train_loader.streams.train.local={data / "train"}',
                            f'eval_loader.streams.eval.local={data / "validation"}',
                            'load_path=null', 'load_weights_only=false']  # its oci:// checkpoint is a placeholder
        assert [t.split(':')[0] for t in todo] == ['to do', 'to do']
        assert 'foundrymix convert finetune /path/to/data/dir/ --preprocess my.import.path:my_preprocessing_fn' \
            in todo[0] and todo[0].endswith('then set train_loader.streams.train.local: DIR')
    if name.startswith('mpt'):
        assert todo == []
    run = train(load_config(str(out), overrides))
    state = run.trainer.state
    assert (int(state.timestamp.batch), int(state.timestamp.sample)) == (2, 8)
    assert torch.isfinite(state.loss).all()
    # LLM-Foundry's flash attention on MPT is eager here: said once at start, not in silence
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith('model.attn_config')]
    assert said == ([ATTN_LINE.format(impl='flash').replace('changed: ', '').replace(' -> eager', '')]
                    if name in ('mpt-125m', '1b_local_data_sft') else [])


@pytest.mark.slow
def test_migrated_gpu_yaml_trains_on_cpu_with_the_offered_overrides(small_streams, tmp_path, capsys, monkeypatch):
    """LLM-Foundry's llama-3-8b_domain_adapt.yaml (FSDP, amp_bf16, save_folder ./{run_name}/checkpoints,
    run_name empty): migrated, its to-dos done and the CPU overrides migrate offers added (the one
    line, as printed), it trains 2 batches on CPU; the run is named after the YAML, and its
    checkpoints and report land in ./<run_name>/, the printed checkpoint path exists, and no
    literal {run_name} directory is made."""
    pytest.importorskip('composer')  # it trains: the composer extra (scripts/test_core.sh has none)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv('RUN_NAME', raising=False)
    name = 'llama-3-8b_domain_adapt'
    lines, out = _report(name, tmp_path, capsys)
    cpu = [line for line in lines if line.startswith('for a CPU trial add: ')]
    assert cpu == [CPU + EVAL.format(end='3195ba')]
    data = _data(small_streams, tmp_path, name)
    scale = ['train_loader.num_workers=0', 'eval_loader.num_workers=0', 'max_duration=2ba',
             'eval_subset_num_batches=1', 'device_eval_batch_size=2']
    overrides = (FIT + [f'variables.data_local={data}'] + _todo_done(name, data, tmp_path)
                 + cpu[0].split(': ', 1)[1].split() + scale)
    assert main(['train', str(out), *overrides]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert 'checkpoints: ./llama-3-8b_domain_adapt/checkpoints' in printed
    run_dir = tmp_path / name
    assert [p.name for p in (run_dir / 'checkpoints').iterdir() if p.suffix == '.pt']
    assert (run_dir / 'report' / 'stream_accounting.json').is_file()
    assert not [p for p in tmp_path.rglob('*') if '{run_name}' in str(p)]


def _tiny_llama(path: Path) -> Path:
    """A 1-layer Llama saved by transformers itself, the bundled tokenizer beside it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from foundrymix.tokenizer import load_tokenizer
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=2, vocab_size=8192, max_position_embeddings=SMALL_SEQ)
                     ).save_pretrained(path)
    load_tokenizer(DEMO_TOKENIZER).save_pretrained(path)
    return path


def _tiny_gpt_neo(path: Path) -> Path:
    """A 1-layer GPT-Neo (global attention) saved by transformers itself, the bundled tokenizer beside it."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    from foundrymix.tokenizer import load_tokenizer
    torch.manual_seed(0)
    GPTNeoForCausalLM(GPTNeoConfig(hidden_size=16, num_layers=1, num_heads=2, attention_types=[[['global'], 1]],
                                   vocab_size=8192, max_position_embeddings=SMALL_SEQ)).save_pretrained(path)
    load_tokenizer(DEMO_TOKENIZER).save_pretrained(path)
    return path


def _tiny_opt(path: Path) -> Path:
    """A 1-layer OPT saved by transformers itself, the bundled tokenizer beside it."""
    from transformers import OPTConfig, OPTForCausalLM

    from foundrymix.tokenizer import load_tokenizer
    torch.manual_seed(0)
    OPTForCausalLM(OPTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32,
                             word_embed_proj_dim=16, vocab_size=8192, max_position_embeddings=SMALL_SEQ)
                   ).save_pretrained(path)
    load_tokenizer(DEMO_TOKENIZER).save_pretrained(path)
    return path


#: what fits each migrated YAML to this machine's data, never a fix of the migration: where the
#: data is (every split the YAMLs name), the tokenizer and row length the streams were made with
FIT = [f'tokenizer={DEMO_TOKENIZER}', f'max_seq_len={SMALL_SEQ}', 'global_train_batch_size=4',
       'device_train_microbatch_size=2']
FINETUNE = ('gpt2-arc-easy-cpu-streaming-dataset', '1b_local_data_sft', '7b_dolly_sft', 'dbrx-lora-ft')


def _data(small_streams, tmp_path: Path, name: str) -> Path:
    data = tmp_path / 'data'
    stream = small_streams['dolly' if name in FINETUNE else 'arxiv']
    for split in ('train', 'val', 'validation', 'test', 'train_small', 'val_small'):
        shutil.copytree(stream, data / split)
    return data


def _todo_done(name: str, data: Path, tmp_path: Path) -> list[str]:
    """The overrides that do what each YAML's to-do lines ask (none for a complete one)."""
    gpt2 = lambda: [f'model.pretrained_model_name_or_path={_tiny_gpt2(tmp_path / "gpt2")}']  # noqa: E731
    neo = lambda: [f'model.pretrained_model_name_or_path={_tiny_gpt_neo(tmp_path / "neo")}']  # noqa: E731
    llama = lambda: [f'model.pretrained_model_name_or_path={_tiny_llama(tmp_path / "llama")}']  # noqa: E731
    streams = [f'train_loader.streams.train.local={data / "train"}']
    return {
        'mpt-125m': [], 'mpt-small-cpu': [], 'testing-moe': [],  # (its to-do deletes a key: DELETE)
        # GPT-Neo ignores position_ids and has no sdpa: the two settings plan asks once the type is known
        'gpt-neo-125m': neo() + ['model.attention=causal', 'model.attn_implementation=eager'],
        # OPT ignores position_ids too (it has sdpa)
        'opt-3b': [f'model.pretrained_model_name_or_path={_tiny_opt(tmp_path / "opt")}', 'model.attention=causal'],
        'gpt2-arc-easy-cpu-streaming-dataset': gpt2(),
        'gpt2-small': gpt2(),  # its config_overrides.n_positions is a gpt2 key: nothing to delete
        # (and their load_path placeholder, oci://my-bucket/...: plan and train refuse it)
        '1b_local_data_sft': streams + [f'eval_loader.streams.eval.local={data / "validation"}',
                                        'load_path=null', 'load_weights_only=false'],
        '7b_dolly_sft': streams + ['load_path=null', 'load_weights_only=false'],
        'llama-3-8b_domain_adapt': llama() + ['model.config_overrides={}'],  # MPT keys on a llama: deleted
        # its LoRA targets DBRX's Wqkv: a tiny DBRX, whose attention ignores position_ids (causal;
        # plan and train say so once the model is a local directory, migrate cannot know before)
        'dbrx-lora-ft': streams + [f'eval_loader.streams.eval.local={data / "test"}',
                                   f'model.pretrained_model_name_or_path={tiny_dbrx(tmp_path / "dbrx")}',
                                   'model.attention=causal'],
    }[name]


#: the keys a YAML's to-do lines say to delete (an override cannot): testing-moe's MoE becomes a
#: dense MLP only when the user deletes ffn_config, the acceptance its to-do names
DELETE = {'testing-moe': ['ffn_config']}


def _delete(out: Path, keys: list[str]) -> None:
    import yaml
    data = yaml.safe_load(out.read_text())
    for key in keys:
        del data['model'][key]
    out.write_text(yaml.safe_dump(data, sort_keys=False))


def _fit(name: str, data: Path) -> list[str]:
    return FIT + [f'variables.data_local={data}'] * ('data_local' in (FOUNDRY_DIR / f'{name}.yaml').read_text())


@pytest.mark.parametrize('name', list(SHIPPED))
def test_migrated_yaml_plans_once_its_to_dos_are_done(name, small_streams, tmp_path, capsys):
    """A YAML migrate calls complete plans with only the data-fit overrides; one with to-do lines
    plans once exactly what they ask is given, and not before (each to-do is real)."""
    lines, out = _report(name, tmp_path, capsys)
    data = _data(small_streams, tmp_path, name)
    fit = _fit(name, data) + ['device=gpu']  # the GPU run it is
    done = _todo_done(name, data, tmp_path)
    assert (COMPLETE in lines) == (done == [] and name not in DELETE)
    if COMPLETE not in lines:
        assert main(['plan', str(out), *fit, *done]) == 2 if name in DELETE else main(['plan', str(out), *fit]) == 2
        err = capsys.readouterr().err
        assert all(f'model.{key}: unknown key' in err for key in DELETE.get(name, [])), err
    _delete(out, DELETE.get(name, []))
    assert main(['plan', str(out), *fit, *done]) == 0, capsys.readouterr().err
    assert 'max_duration' in capsys.readouterr().out


def test_foundry_model_keys_are_named_not_guessed(tmp_path, capsys):
    """LLM-Foundry MPT's ffn_config and the Hub keys: migrate says what each is, and the config
    reader's refusal (should one reach it) says the same instead of the nearest transformers key."""
    src = tmp_path / 'mpt-glu.yaml'
    src.write_text('max_seq_len: 128\nglobal_train_batch_size: 4\nmax_duration: 2ba\n'
                   'precision: amp_bf16\ndevice_train_microbatch_size: auto\n'
                   'train_loader: {streams: {a: {local: /nowhere}}}\n'
                   'model: {name: mpt_causal_lm, d_model: 16, n_heads: 2, n_layers: 1, vocab_size: 8192,\n'
                   '        ffn_config: {ffn_type: mptglu}, use_auth_token: true,\n'
                   '        init_config: {name: kaiming_normal_},\n'
                   '        attn_config: {attn_impl: triton}}\n')
    assert main(['migrate', str(src)]) == 0
    report = [line[2:] for line in capsys.readouterr().out.splitlines() if line.startswith('# ')]
    assert report[-2:] == ['to do: 1 line(s) above before it runs',  # then a GPU YAML's CPU trial
                           'for a CPU trial add: precision=fp32 device_train_microbatch_size=null']
    assert [line for line in report if line.startswith(('to do: model', 'removed: model', 'changed: model.attn'))] == [
        ATTN_LINE.format(impl='triton'),
        AUTH,
        "removed: model.init_config: {'name': 'kaiming_normal_'}: LLM-Foundry MPT's init_config has no equivalent: "
        "transformers initialises the weights (initializer_range)",
        "to do: model.ffn_config: {'ffn_type': 'mptglu'}: LLM-Foundry MPT's ffn_config has no equivalent: "
        "transformers' MPT has one MLP (d_model x expansion_ratio, GELU: LLM-Foundry's default ffn_type mptmlp); "
        "kept, so plan and train refuse the YAML: delete model.ffn_config to accept that MLP instead (a different "
        "model), or keep this run on LLM-Foundry"]
    # as it is (MPT written as transformers' type), the reader names LLM-Foundry's keys for what they are
    src.write_text(src.read_text().replace('name: mpt_causal_lm', 'type: mpt, attention: causal'))
    with pytest.raises(ConfigErrors) as err:
        load_config(str(src))
    text = str(err.value)
    assert 'did you mean' not in text
    assert ("model.ffn_config: unknown key for a 'mpt' model (transformers mpt config); LLM-Foundry MPT's "
            "ffn_config has no equivalent") in text
    assert "model.use_auth_token: unknown key for a 'mpt' model (transformers mpt config); LLM-Foundry's " \
           "Hugging Face Hub token has no equivalent" in text


def test_encoder_decoder_models_are_refused_by_name(small_streams, tmp_path, capsys):
    """LLM-Foundry's t5-small_dolly_sft.yaml is refused by migrate in one line, and so is any
    encoder-decoder type at plan (by type, or as the pretrained directory's); transformers itself
    has no causal LM for T5, so such a run could never train."""
    from transformers import AutoModelForCausalLM, T5Config

    from foundrymix.train.model_spec import ModelSpec
    with pytest.raises(ValueError, match='Unrecognized configuration class'):
        AutoModelForCausalLM.from_config(T5Config(num_layers=1, d_model=8, d_ff=8, num_heads=1, d_kv=8))
    out = tmp_path / 'new.yaml'
    assert main(['migrate', str(FOUNDRY_DIR / 't5-small_dolly_sft.yaml'), '--out', str(out)]) == 2
    err = capsys.readouterr().err
    line = ("model: 't5' is an encoder-decoder model; foundrymix trains decoder-only causal LMs (llama, gpt2, mpt, "
            "...): keep this run on LLM-Foundry")
    assert err.splitlines() == [f'foundrymix migrate: error: {line}'] and not out.exists()
    for model_type in ('t5', 'bart'):
        with pytest.raises(ConfigError) as e:
            ModelSpec.from_dict({'type': model_type})  # one line: not also its attention or keys
        assert str(e.value) == (f"model: {model_type!r} is an encoder-decoder model; foundrymix trains decoder-only "
                                f"causal LMs (llama, gpt2, mpt, ...): keep this run on LLM-Foundry")
    T5Config(num_layers=1, d_model=8, d_ff=8, num_heads=1, d_kv=8).save_pretrained(tmp_path / 't5')
    src = tmp_path / 'f.yaml'  # a local T5 directory under hf_causal_lm: its type is read and refused
    src.write_text((FOUNDRY_DIR / 'gpt2-small.yaml').read_text().replace(
        'pretrained_model_name_or_path: gpt2', f'pretrained_model_name_or_path: {tmp_path / "t5"}'))
    assert main(['migrate', str(src)]) == 2
    assert capsys.readouterr().err.splitlines() == [f'foundrymix migrate: error: {line}']
    src.write_text(f'max_seq_len: {SMALL_SEQ}\nglobal_train_batch_size: 4\nmax_duration: 2ba\n'
                   f'train_loader: {{streams: {{a: {{local: {small_streams["arxiv"]}}}}}}}\n'
                   f'model: {{pretrained: {tmp_path / "t5"}}}\n')
    assert main(['plan', str(src)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and line in err, err


@pytest.mark.parametrize('model_type, kwargs', [
    ('gpt_neo', {'hidden_size': 16, 'num_layers': 1, 'num_heads': 2, 'attention_types': [[['global'], 1]]}),
    ('gpt2', {'n_embd': 16, 'n_layer': 1, 'n_head': 2}),
    ('opt', {'hidden_size': 16, 'num_hidden_layers': 1, 'num_attention_heads': 2, 'ffn_dim': 32,
             'word_embed_proj_dim': 16}),
    ('mpt', {'d_model': 16, 'n_heads': 2, 'n_layers': 1}),
])
def test_eager_is_chosen_exactly_where_transformers_refuses_sdpa(model_type, kwargs):
    """Independent check of :func:`has_sdpa`: building the real model with sdpa raises exactly
    for the types it says lack it, and the attention plan picks then builds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from foundrymix.train.model_spec import ModelSpec, has_sdpa
    config = AutoConfig.for_model(model_type, vocab_size=64, **kwargs)
    try:
        AutoModelForCausalLM.from_config(config, attn_implementation='sdpa')
        refused = False
    except ValueError as e:
        refused = 'scaled_dot_product_attention' in str(e)
    assert refused == (not has_sdpa(model_type)) == (model_type in ('gpt_neo', 'mpt'))
    spec = ModelSpec.from_dict({'type': model_type, 'attention': 'causal', **kwargs})
    assert spec.attn_implementation == ('eager' if refused else None)
    AutoModelForCausalLM.from_config(config, attn_implementation=spec.attn_implementation or 'sdpa')
    if refused and model_type != 'mpt':
        with pytest.raises(ConfigError, match=rf"^model.attn_implementation: 'sdpa': "
                           rf"transformers' '{model_type}' has no sdpa attention; leave attn_implementation out"):
            ModelSpec.from_dict({'type': model_type, 'attention': 'causal', 'attn_implementation': 'sdpa', **kwargs})


def _neo_local(tmp_path: Path) -> Path:
    """LLM-Foundry's gpt-neo-125m.yaml with its Hub name replaced by a local GPT-Neo directory."""
    src = tmp_path / 'gpt-neo-125m.yaml'
    src.write_text((FOUNDRY_DIR / 'gpt-neo-125m.yaml').read_text().replace(
        'EleutherAI/gpt-neo-125M', str(_tiny_gpt_neo(tmp_path / 'neo'))))
    return src


def _attends_per_document(model_dir: Path) -> bool:
    """Measured on the model itself, called as the trainer calls it (no mask, no cache): with
    restarting position_ids, are the second document's logits those of the document alone (the
    installed transformers decides)?"""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation='eager').eval()
    a, b = torch.tensor([[11, 12, 13, 14]]), torch.tensor([[21, 22, 23, 24]])
    with torch.no_grad():
        packed = model(input_ids=torch.cat([a, b], 1), position_ids=torch.tensor([[0, 1, 2, 3] * 2]),
                       use_cache=False).logits
        alone = model(input_ids=b, position_ids=torch.tensor([[0, 1, 2, 3]]), use_cache=False).logits
    return torch.allclose(packed[:, 4:], alone, atol=1e-5)


def test_a_local_gpt_neo_migrates_complete_and_plans(small_streams, tmp_path, capsys):
    """With the model a local directory, migrate knows its type: GPT-Neo gets causal attention
    where it attends across packed documents (measured here on the model), eager (it has no
    sdpa), the migration is complete, and it plans with only the data-fit overrides; its config
    override is a gpt_neo key, kept."""
    src, out = _neo_local(tmp_path), tmp_path / 'new.yaml'
    assert main(['migrate', str(src), '--out', str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    causal = [] if _attends_per_document(tmp_path / 'neo') else [
        "changed: model.attention: causal (transformers' 'gpt_neo' ignores position_ids, so document attention "
        "is refused)"]
    assert [line for line in lines if line.startswith(('changed: model.', 'to do', 'complete', 'for a CPU'))] == [
        *causal, "changed: model.attn_implementation: eager (transformers' 'gpt_neo' has no sdpa attention)",
        COMPLETE, CPU + EVAL.format(end='4800ba')]
    assert 'model.config_overrides' in next(line for line in lines if line.startswith('kept: model.'))
    data = _data(small_streams, tmp_path, 'gpt-neo-125m')
    assert main(['plan', str(out), *_fit('gpt-neo-125m', data), 'device=gpu']) == 0, capsys.readouterr().err


def test_foundry_mpt_overrides_on_a_local_llama_are_removed(tmp_path, capsys):
    """llama-3-8b_domain_adapt.yaml with a local Llama: its config_overrides are LLM-Foundry MPT
    keys that a llama config lacks (LLM-Foundry's own set_config_overrides refused them there too):
    removed with that reason, so the migration is complete and reads."""
    src = tmp_path / 'llama.yaml'
    src.write_text((FOUNDRY_DIR / 'llama-3-8b_domain_adapt.yaml').read_text().replace(
        'meta-llama/Meta-Llama-3-8B', str(_tiny_llama(tmp_path / 'llama'))))
    lines, out = _report_of(src, tmp_path, capsys)
    assert [line.split(': LLM-Foundry')[0] for line in lines if 'config_overrides' in line] == [
        'removed: model.config_overrides.max_seq_len', 'removed: model.config_overrides.attn_config']
    assert all(line.endswith("(LLM-Foundry refused it on a llama config too)") for line in lines
               if 'config_overrides' in line)
    assert COMPLETE in lines
    cfg = load_config(str(out))
    assert (cfg.model.model_type, cfg.model.attention, cfg.model.config_kwargs) == ('llama', 'document', {})


def _report_of(src: Path, tmp_path: Path, capsys) -> tuple[list[str], Path]:
    out = tmp_path / 'new.yaml'
    assert main(['migrate', str(src), '--out', str(out)]) == 0
    return capsys.readouterr().out.splitlines(), out


@pytest.mark.slow
@pytest.mark.parametrize('name', ['gpt2-small', '7b_dolly_sft', 'gpt-neo-125m', 'opt-3b', 'testing-moe'])
def test_the_other_migrated_yamls_train_two_batches(name, small_streams, tmp_path, capsys):
    """The shipped YAMLs no other test trains: migrated (GPT-Neo from a local directory, so
    migrate sets its attention), to-dos done, with the CPU trial line as printed and the fit
    overrides, each trains two batches on CPU and evaluates one batch."""
    pytest.importorskip('composer')
    src = _neo_local(tmp_path) if name == 'gpt-neo-125m' else FOUNDRY_DIR / f'{name}.yaml'
    lines, out = _report_of(src, tmp_path, capsys)
    data = _data(small_streams, tmp_path, name)
    done = [] if name == 'gpt-neo-125m' else _todo_done(name, data, tmp_path)
    _delete(out, DELETE.get(name, []))
    cpu = next(line for line in lines if line.startswith('for a CPU trial add: ')).split(': ', 1)[1].split()
    scale = MPT[:-1] if name in ('7b_dolly_sft', 'testing-moe') else []
    overrides = [*_fit(name, data), *done, *cpu, *scale, 'max_duration=2ba', 'train_loader.num_workers=0',
                 'device_eval_batch_size=2', f'save_folder={tmp_path / "ckpt"}']
    if 'eval_loader' in out.read_text():
        overrides.append('eval_loader.num_workers=0')
    assert main(['train', str(out), *overrides]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert 'Traceback' not in printed

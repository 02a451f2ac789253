"""`foundrymix migrate`: LLM-Foundry's mpt-125m.yaml (13 refusals in one reading) becomes a YAML the
config reader accepts; every change and every setting without equivalent is listed; the input
is only read and --out never replaces a file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import DEMO_TOKENIZER, SMALL_SEQ

from foundrymix.cli import main
from foundrymix.config import ConfigErrors
from foundrymix.train.config import load_config

#: LLM-Foundry's own YAMLs (tests/data/foundry/README.md: source, commit and license)
FOUNDRY_DIR = Path(__file__).resolve().parent.parent / 'data' / 'foundry'

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
REPORT = [
    'changed: data_local: moved under variables (${data_local} -> ${variables.data_local})',
    'changed: data_remote: moved under variables (${data_remote} -> ${variables.data_remote})',
    'changed: global_seed: moved under variables (${global_seed} -> ${variables.global_seed})',
    FSDP_LINE,
    'changed: console_log_interval -> log_interval',
    'changed: run_name: empty -> left out (the default applies)',
    'changed: tokenizer: {name: EleutherAI/gpt-neox-20b, ...} -> tokenizer: EleutherAI/gpt-neox-20b',
    'changed: train_loader.dataset.{local, remote, split} -> train_loader.streams.train',
    'changed: train_loader.dataset.shuffle -> train_loader.shuffle',
    'changed: train_loader.dataset.shuffle_seed -> train_loader.shuffle_seed',
    'changed: eval_loader.dataset.{local, remote, split} -> eval_loader.streams.eval',
    'changed: eval_loader.dataset.shuffle -> eval_loader.shuffle',
    'changed: eval_loader.dataset.shuffle_seed -> eval_loader.shuffle_seed',
    'changed: model.name: mpt_causal_lm -> model.type: mpt',
    "changed: model.attention: causal (transformers' MPT ignores position_ids, so document attention is refused)",
    "removed: log_to_console: LLM-Foundry's log_to_console: the console logger is on unless loggers leaves it "
    "out (loggers: {console: {}})",
    'removed: tokenizer.kwargs (model_max_length): no equivalent (max_seq_len and the streams decide)',
    "removed: train_loader.name: text (each stream's converted format decides)",
    'removed: train_loader.dataset.max_seq_len: the top-level max_seq_len says it',
    "removed: eval_loader.name: text (each stream's converted format decides)",
    'removed: eval_loader.dataset.max_seq_len: the top-level max_seq_len says it',
    'removed: model.init_device: meta: no equivalent (fsdp builds the model)',
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


def test_migrate_lists_what_it_cannot_rewrite(tmp_path, capsys):
    src = tmp_path / 'f.yaml'
    src.write_text('max_seq_len: 64\neval_interval: 1\nsave_interval: 0.5\noptimizer: {name: decoupled_lionw}\n'
                   'icl_tasks: []\ncallbacks: {hf_checkpointer: {}}\n')
    assert main(['migrate', str(src)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:4] == [
        '# changed: eval_interval: 1 -> 1ep (an int is epochs in Composer, which LLM-Foundry hands it to)',
        "# removed: icl_tasks: LLM-Foundry's in-context-learning evaluation (icl_tasks) is not supported",
        '# removed: callbacks.hf_checkpointer: no equivalent (here: stream_accounting, sample_log, stop_at, '
        'speed_monitor, lr_monitor, memory_monitor, runtime_estimator)',
        '# to do: save_interval: 0.5 has no unit: give one (e.g. 0.5ep; Composer reads an int as epochs)']
    assert 'name: decoupled_lionw' in out  # kept: foundrymix has it (tests/train/test_optim.py)


def _report(name: str, tmp_path, capsys) -> tuple[list[str], Path]:
    out = tmp_path / 'new.yaml'
    assert main(['migrate', str(FOUNDRY_DIR / f'{name}.yaml'), '--out', str(out)]) == 0
    return capsys.readouterr().out.splitlines(), out


#: the lines every one of the shipped YAMLs gets (they share these sections)
COMMON = ['changed: console_log_interval -> log_interval',
          "removed: log_to_console: LLM-Foundry's log_to_console: the console logger is on unless loggers leaves it "
          "out (loggers: {console: {}})",
          'removed: tokenizer.kwargs (model_max_length): no equivalent (max_seq_len and the streams decide)']
RUN_NAME = 'changed: run_name: ${variables.run_name} is empty -> left out (the default applies)'
MPT_LINES = ['changed: model.name: mpt_causal_lm -> model.type: mpt',
             "changed: model.attention: causal (transformers' MPT ignores position_ids, so document attention is "
             "refused)"]
HF_TODO = ("to do: {loader}.dataset (hf_name: json, hf_kwargs: {{'data_dir': '/path/to/data/dir/'}}, preprocessing_fn: "
           "my.import.path:my_preprocessing_fn): a Hugging Face dataset read at training time; here data is converted "
           "once: foundrymix convert finetune /path/to/data/dir/ --preprocess my.import.path:my_preprocessing_fn "
           "--out DIR (the {split} split's files), then set {loader}.streams.{stream}.local: DIR")
#: per shipped YAML: (lines it must print, besides COMMON; how many lines in all)
SHIPPED = {
    'mpt-125m': ([FSDP_LINE, RUN_NAME, *MPT_LINES,
                  'changed: train_loader.dataset.{local, remote, split} -> train_loader.streams.train',
                  'changed: eval_loader.dataset.{local, remote, split} -> eval_loader.streams.eval',
                  'removed: model.init_device: meta: no equivalent (fsdp builds the model)'], 19),
    'mpt-small-cpu': ([FSDP_LINE, *MPT_LINES,
                       "removed: model.loss_fn: torch_crossentropy: no equivalent (the loss is transformers' "
                       "cross-entropy on the labels)"], 19),
    'gpt2-arc-easy-cpu-streaming-dataset': ([
        RUN_NAME, 'changed: train_loader.dataset.streams -> train_loader.streams',
        'changed: eval_interval: 1 -> 1ep (an int is epochs in Composer, which LLM-Foundry hands it to)',
        'removed: model.name: hf_causal_lm (pretrained_model_name_or_path says the model)',
        'removed: train_loader.dataset.decoder_only_format: no equivalent',
        'to do: model.pretrained_model_name_or_path: gpt2: give a local Hugging Face model directory (models are '
        'never downloaded; e.g. save_pretrained() it once)'], 13),
    '1b_local_data_sft': ([
        FSDP_LINE, 'changed: run_name: empty -> left out (the default applies)', *MPT_LINES,
        'removed: dataset: a block the YAML merges into train_loader.dataset and eval_loader.dataset '
        '(<<: *anchor), migrated there',
        'removed: train_loader.dataset.allow_pad_trimming: no equivalent',
        HF_TODO.format(loader='train_loader', split='train', stream='train'),
        HF_TODO.format(loader='eval_loader', split='validation', stream='eval')], 20),
}


@pytest.mark.parametrize('name', list(SHIPPED))
def test_migrate_reports_the_shipped_foundry_yamls(name, tmp_path, capsys):
    """Each of LLM-Foundry's shipped YAMLs: the important lines exactly, every line a change, a
    removal with its reason or a to do, and the migrated YAML reads (data paths aside)."""
    before = (FOUNDRY_DIR / f'{name}.yaml').read_bytes()
    lines, out = _report(name, tmp_path, capsys)
    expected, count = SHIPPED[name]
    for line in COMMON + expected:
        assert line in lines, line
    assert len(lines) == count + 1 and lines[-1] == f'wrote {out}; check it with: foundrymix plan {out}'
    assert all(line.split(': ')[0] in ('changed', 'removed', 'to do') for line in lines[:-1])
    assert all(': ' in line.split(': ', 1)[1] or ' -> ' in line for line in lines[:-1])  # says what/why
    if name.startswith('mpt'):
        load_config(str(out))  # reads as it is
    assert (FOUNDRY_DIR / f'{name}.yaml').read_bytes() == before  # only read


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
    from foundrymix.train.builder import train

    out = tmp_path / 'new.yaml'
    assert main(['migrate', str(FOUNDRY_DIR / f'{name}.yaml'), '--out', str(out)]) == 0
    todo = [line for line in capsys.readouterr().out.splitlines() if line.startswith('to do:')]
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
        assert todo == ['to do: model.pretrained_model_name_or_path: gpt2: give a local Hugging Face model '
                        'directory (models are never downloaded; e.g. save_pretrained() it once)']
    else:  # an HF json dataset with a preprocessing function: converted first, here already
        overrides += MPT + [f'train_loader.streams.train.local={data}', f'eval_loader.streams.eval.local={data}',
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

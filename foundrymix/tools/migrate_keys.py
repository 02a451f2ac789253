"""What ``foundrymix migrate`` does with the keys its renames do not cover, the read-back and a
CPU trial's overrides. Every input key is named once (kept, changed, removed, or to do), and the
migrated YAML is read back by ``train``'s reader: what it would refuse is a to-do line.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

from foundrymix.config import ConfigError, errors_of

#: LLM-Foundry loader ``dataset`` keys with no equivalent: why, and what decides it here
DATASET_KEYS = {
    'decoder_only_format': 'finetune streams are decoder-only: prompt then response, loss on the response',
    'allow_pad_trimming': 'finetune rows are packed full by `foundrymix convert finetune`; no padding to trim',
    'packing_ratio': '`foundrymix convert finetune` packs examples first-fit into full rows once',
    'eos_token_id': "the tokenizer's EOS, recorded in each stream's manifest, ends the documents",
    'tokenizer_name': 'the top-level tokenizer says it',
    'target_responses': '`foundrymix convert finetune --chat-loss last|all` decides it when converting',
    'target_prompts': '`foundrymix convert finetune --loss-on-prompt` decides it when converting',
}


def show(value: Any) -> str:
    """A value as the YAML writes it (true, null), not as Python prints it."""
    return json.dumps(value) if isinstance(value, bool) or value is None else str(value)


_HEAD = re.compile(r'[\w.\[\]{}*-]+')


def head(line: str) -> str:
    """The key path a report line is about (``model.peft_config`` of ``model.peft_config (...): ...``)."""
    m = _HEAD.match(line)
    return m.group(0) if m else ''


def model_type(model: dict[str, Any]) -> Optional[str]:
    """The transformers model_type of a migrated model section, when it can be known here."""
    known = model.get('type') or model.get('model_type')
    if known:
        return str(known)
    path = model.get('pretrained_model_name_or_path') or model.get('pretrained')
    config = os.path.join(str(path), 'config.json') if isinstance(path, str) else ''
    if config and os.path.isfile(config):
        with open(config, encoding='utf-8') as f:
            return json.load(f).get('model_type')
    return None


def _advice(key: str, mtype: Optional[str]) -> str:
    from foundrymix.train.model_spec import foundry_model_advice
    text = foundry_model_advice(key, mtype or 'this') or ''
    return text.split('; delete it')[0]


def model_keys(m: Any) -> None:
    """The model section's keys beyond ``name``/``init_device``/``loss_fn``: the pretrained model a
    local directory, LLM-Foundry's own keys rewritten or removed with their reason, every other key
    checked against the transformers config of the model's type (or left to do while it is unknown)."""
    from foundrymix.train.model_spec import OWN_KEYS, config_keys, mpt_attention_line

    model = m.data.get('model')
    if not isinstance(model, dict):
        return
    if isinstance(model.get('pretrained'), bool):
        m.carried.append(f"model.pretrained: {show(model['pretrained'])}: "
                         + ('load the weights of the model directory' if model['pretrained'] else
                            "the model directory's config only, the weights initialised at random")
                         + ', as in LLM-Foundry')
    name = model.get('pretrained_model_name_or_path')
    if isinstance(name, str) and not os.path.isdir(name):  # a hub name: models are never downloaded
        m.todo.append(f'model.pretrained_model_name_or_path: {name}: give a local Hugging Face model '
                      f'directory (models are never downloaded; e.g. save_pretrained() it once)')
    mtype = model_type(model)
    if 'use_flash_attention_2' in model:
        value = model.pop('use_flash_attention_2')
        if value is True and 'attn_implementation' not in model:
            model['attn_implementation'] = 'flash_attention_2'
            m.changes.append('model.use_flash_attention_2: true -> model.attn_implementation: flash_attention_2 '
                             '(GPU only, with flash-attn installed)')
        else:
            m.dropped.append(f'model.use_flash_attention_2: {show(value)}: attn_implementation decides (default sdpa)')
    for key in ('use_auth_token', 'trust_remote_code', 'init_config', 'fc_type'):
        if key in model:
            m.dropped.append(f'model.{key}: {show(model.pop(key))}: {_advice(key, mtype)}')
    if model.get('peft_config') is not None:
        peft = model['peft_config']
        what = ', '.join(f'{k}: {v}' for k, v in peft.items()) if isinstance(peft, dict) else str(peft)
        m.carried.append(f'model.peft_config ({what}): LoRA through the peft library, as in LLM-Foundry: the '
                         f'base weights are frozen, the adapter trains; target_modules are checked against the '
                         f"model's layers at start; export writes the merged model, or with --adapter the "
                         f'adapter alone')
    if 'ffn_config' in model and mtype == 'mpt':
        ffn = model['ffn_config']
        line = f'model.ffn_config: {ffn}: {_advice("ffn_config", mtype)}'
        if isinstance(ffn, dict) and set(ffn) <= {'ffn_type'} and ffn.get('ffn_type', 'mptmlp') == 'mptmlp':
            model.pop('ffn_config')
            m.dropped.append(line)
        else:  # kept, so plan and train refuse it: deleting it is the user's acceptance
            instead = 'a dense MLP instead of its experts' if 'moe' in str(ffn) else 'that MLP instead'
            m.todo.append(f'{line}; kept, so plan and train refuse the YAML: delete model.ffn_config to accept '
                          f'{instead} (a different model), or keep this run on LLM-Foundry')
    if mtype is not None:
        _attention(m, model, mtype)
    if mtype == 'mpt':
        attn = model.get('attn_config')
        given = isinstance(attn, dict) and attn.get('attn_impl') is not None
        line = mpt_attention_line('mpt', model if given else {'attn_config': {'attn_impl': 'flash'}})
        if line:
            m.changes.append(line.replace(': transformers', ' -> eager: transformers', 1) if given else
                             "model.attn_config.attn_impl: (LLM-Foundry MPT's default flash) -> eager: "
                             + line.split(': ', 2)[2])
    overrides = model.get('config_overrides')
    keys = [(f'model.{k}', k) for k in model if k not in OWN_KEYS]
    keys += [(f'model.config_overrides.{k}', k) for k in (overrides if isinstance(overrides, dict) else {})]
    if not keys and mtype is not None:
        return
    if mtype is None:
        keys = [('model.attention', 'attention')] * ('attention' not in model) + keys
        if keys:
            m.todo.append(f'{", ".join(p for p, _ in keys)}: checked against the model\'s type once '
                          f'model.pretrained_model_name_or_path is a local directory (`foundrymix plan` names '
                          f'what it refuses: attention: causal for a type that ignores position_ids, '
                          f'attn_implementation: eager for one without sdpa, a key its config lacks)')
        return
    try:
        valid = config_keys(mtype)
    except KeyError:
        return  # the read-back names the unknown type
    for path, key in keys:
        if key in valid or any(line.startswith(path + ':') for line in m.todo):
            continue
        advice = _advice(key, mtype)
        if advice:  # LLM-Foundry's own key: its config refused it too ("config does not have attribute")
            (overrides if path.startswith('model.config_overrides.') else model).pop(key)
            m.dropped.append(f'{path}: {advice} (LLM-Foundry refused it on a {mtype} config too)')
        else:
            m.todo.append(f"{path}: not a key of transformers' {mtype} config: delete it, or give the key of "
                          f"that config that means it")
    if overrides == {} and any(line.startswith('model.config_overrides.') for line in m.dropped):
        model.pop('config_overrides')  # each of its keys removed, with its line


def _attention(m: Any, model: dict[str, Any], mtype: str) -> None:
    """``attention`` and ``attn_implementation`` as ``plan`` accepts them for ``mtype``: causal for a
    model that ignores position_ids, eager for one without sdpa; an explicit value stays, and the
    read-back turns a refused one into a to-do."""
    from foundrymix.train.model_spec import check_model_type, has_sdpa, reads_position_ids

    check_model_type(mtype, 'model')  # an encoder-decoder model: refused here, in one line
    who = 'MPT' if mtype == 'mpt' else repr(mtype)
    if 'attention' not in model and not reads_position_ids(mtype):
        model['attention'] = 'causal'
        m.changes.append(f"model.attention: causal (transformers' {who} ignores position_ids, so document "
                         f"attention is refused)")
    if 'attn_implementation' not in model and mtype != 'mpt' and not has_sdpa(mtype):
        model['attn_implementation'] = 'eager'
        m.changes.append(f"model.attn_implementation: eager (transformers' {who} has no sdpa attention)")


def read_back(m: Any) -> None:
    """Read the migrated YAML as ``train`` reads it; each refusal not already to do is one."""
    from omegaconf import OmegaConf

    from foundrymix.train.config import TrainConfig

    todo = {head(line) for line in m.todo}

    def covered(path: str) -> bool:  # a to-do about that key already says what to give
        return (any(path == t or path.startswith(t + '.') or t.startswith(path + '.') for t in todo)
                or any(path + '.' in line or path + ':' in line for line in m.todo))
    try:
        data = OmegaConf.to_container(OmegaConf.create(m.data), resolve=True)
        TrainConfig.from_dict(data)
    except ConfigError as e:
        for err in errors_of(e):
            path = err.path or head(str(err))
            if not covered(path):
                m.todo.append(f'{err} (the migrated YAML is refused so)')
    except Exception as e:  # noqa: BLE001 -- an interpolation omegaconf cannot resolve
        if type(e).__module__.startswith('omegaconf'):
            m.todo.append(f'{type(e).__name__}: {e}'.replace('\n', ' '))
        else:
            raise


def kept(m: Any, original: dict[str, Any], renamed: set[str]) -> list[str]:
    """The input's keys migrate carried unchanged (``renamed``: the new names of renamed
    sections, whose keys are carried as the rename line says), in a line or two: a key no
    line names, or the unnamed keys inside one whose line names only some of its keys."""
    said = m.changes + m.dropped + m.todo + m.carried
    tops = {head(line).split('.')[0] for line in said} | renamed

    def named(path: str, below: bool) -> bool:  # model.pretrained is not model.pretrained_...
        end = r'\.' if below else r'(?![\w.])'
        return any(re.search(rf'(?<![\w.]){re.escape(path)}{end}', line) for line in said)

    def inner(path: str, value: dict[str, Any]) -> list[str]:
        out = []
        for k, v in value.items():
            if named(f'{path}.{k}', below=False):
                continue
            out += inner(f'{path}.{k}', v) if isinstance(v, dict) and named(f'{path}.{k}', below=True) else \
                [f'{path}.{k}']
        return out
    top_kept, inner_kept = [], []
    for key, value in m.data.items():
        if key not in original and key not in renamed:
            continue
        if key not in tops:
            top_kept.append(key)
        elif isinstance(value, dict) and key not in renamed:
            inner_kept += inner(key, value)
    return [f'kept: {", ".join(keys)} (the same keys and meaning here)' for keys in (top_kept, inner_kept) if keys]


def cpu_overrides(data: dict[str, Any]) -> list[str]:
    """The ``key=value`` overrides that make a trial of the YAML a short CPU run: no GPU-only
    settings, and an unbounded evaluation cut to one batch, once, at the end."""
    out = []
    if data.get('fsdp') is not None:
        out.append('fsdp=null')
    if str(data.get('precision', 'auto')).startswith('amp'):
        out.append('precision=fp32')
    if data.get('device_train_microbatch_size') == 'auto':
        out.append('device_train_microbatch_size=null')
    model = data.get('model')
    if isinstance(model, dict) and model.get('attn_implementation') == 'flash_attention_2':
        from foundrymix.train.model_spec import has_sdpa
        mtype = model_type(model)
        out.append(f"model.attn_implementation={'eager' if mtype and not has_sdpa(mtype) else 'sdpa'}")
    if data.get('eval_loader') and data.get('eval_subset_num_batches', -1) == -1:
        out.append('eval_subset_num_batches=1')
        end = data.get('max_duration')
        if isinstance(end, str) and data.get('eval_interval', '1ep') != end:
            out.append(f'eval_interval={end}')
    return out

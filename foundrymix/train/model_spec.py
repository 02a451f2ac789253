"""The ``model`` section of a training YAML, read without building a model.

Every key that is not ours is checked against the transformers config class of ``type``:
``AutoConfig`` silently ignores a misspelt key (``hiden_size``), training a model of the wrong
size. transformers is imported only when a ``model`` section is read.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import inspect
import json
import os
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

from foundrymix.config import ConfigError, Gather, foundry_advice, to_plain
from foundrymix.train.lora import read_peft_config

AttentionMode = Literal['document', 'causal']
AttnImplementation = Literal['sdpa', 'eager', 'flash_attention_2', 'flex_attention']

#: our keys; every other key of the section is a transformers config field
OWN_KEYS = ('type', 'model_type', 'attention', 'attn_implementation', 'pretrained',
            'pretrained_model_name_or_path', 'config_overrides', 'peft_config', 'fused_loss')


#: LLM-Foundry ``model`` keys that are no transformers config field: what each is here
FOUNDRY_MODEL_KEYS = {
    'use_auth_token': "LLM-Foundry's Hugging Face Hub token has no equivalent: models are never "
                      "downloaded here, a local model directory needs no token; delete it",
    'trust_remote_code': "LLM-Foundry's trust_remote_code has no equivalent: transformers' own model "
                         "classes are used, no code from a model directory runs; delete it",
    'use_flash_attention_2': "LLM-Foundry's use_flash_attention_2: true is attn_implementation: "
                             "flash_attention_2 here (GPU, flash-attn installed); delete it",
    'ffn_config': "LLM-Foundry MPT's ffn_config has no equivalent: transformers' MPT has one MLP "
                  "(d_model x expansion_ratio, GELU: LLM-Foundry's default ffn_type mptmlp); delete it",
    'init_config': "LLM-Foundry MPT's init_config has no equivalent: transformers initialises the weights "
                   "(initializer_range); delete it",
    'fc_type': "LLM-Foundry MPT's fc_type has no equivalent: torch's linear layers; delete it",
    'attn_config': "LLM-Foundry MPT's attn_config is no {type} setting: attention is attn_implementation "
                   "here (sdpa, eager, flash_attention_2); delete it",
    'max_seq_len': "LLM-Foundry MPT's max_seq_len is no {type} setting: the top-level max_seq_len sets the "
                   "rows, the model's positions are its max_position_embeddings (or n_positions); delete it",
}


def foundry_model_advice(key: str, model_type: str) -> Optional[str]:
    """What an LLM-Foundry model key the ``model_type`` config lacks is here, or None."""
    advice = FOUNDRY_MODEL_KEYS.get(key)
    return advice.replace('{type}', repr(model_type)) if advice else None


def mpt_attention_line(model_type: str, config_kwargs: Mapping[str, Any]) -> Optional[str]:
    """One line when an MPT model asks LLM-Foundry's flash or triton attention, which
    transformers' MPT lacks: it computes eager attention instead, never in silence."""
    attn = config_kwargs.get('attn_config')
    impl = attn.get('attn_impl') if isinstance(attn, Mapping) else None
    if model_type != 'mpt' or impl in (None, 'torch'):
        return None
    return (f"model.attn_config.attn_impl: {impl}: transformers' MPT computes eager attention (the same "
            f"values, slower and more memory than {impl}); for sdpa or flash_attention_2 use a model type "
            f"that has them (llama, gpt2, ...)")


class ModelConfigError(ConfigError):
    """The ``model`` section does not describe a causal LM that fits the data."""


@dataclass
class ModelSpec:
    """The ``model`` section: a transformers ``model_type`` plus its config fields (every key not
    in :data:`OWN_KEYS`, and ``config_overrides``, overrides the transformers config)."""

    model_type: str
    attention: AttentionMode
    config_kwargs: dict[str, Any]
    #: local HF model directory: config (and, with ``load_weights``, weights) come from it
    pretrained: Optional[str] = None
    load_weights: bool = False
    #: ``None``: ``sdpa`` (document attention via a block-diagonal mask from position ids)
    attn_implementation: Optional[AttnImplementation] = None
    #: ``peft_config``: peft ``LoraConfig`` keyword arguments (:mod:`foundrymix.train.lora`), or None
    peft: Optional[dict[str, Any]] = None
    #: ``fused_loss``: output layer + cross-entropy in chunks (:mod:`foundrymix.train.fused_loss`)
    fused_loss: bool = False

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> 'ModelSpec':
        return cls.from_config(d, 'model')

    @classmethod
    def from_config(cls, value: Any, where: str) -> 'ModelSpec':
        d = to_plain(value, where)
        gather = Gather()  # every problem of the section at once
        overrides: dict[str, Any] = {}
        with gather:
            overrides = to_plain(d.pop('config_overrides', None), f'{where}.config_overrides')
        pretrained, load_weights = None, False
        with gather:
            pretrained, load_weights = _read_pretrained(d, where)
        model_type = d.pop('type', None) or d.pop('model_type', None)
        foundry_name = d.get('name')
        with gather:
            if pretrained is not None:
                model_type = _pretrained_type(pretrained, model_type, where)
            elif not model_type and not gather.errors:  # (a bad pretrained path said it already)
                hint = (f" (LLM-Foundry's name: {foundry_name} is type: "
                        f"{_FOUNDRY_NAMES.get(str(foundry_name), 'a transformers model_type')} here)"
                        if foundry_name else '')
                raise ModelConfigError(f"{where}: needs 'type' (a transformers model_type such as "
                                       f"llama or gpt2) or 'pretrained' (a local Hugging Face model "
                                       f"directory){hint}", path=f'{where}.type')
        attention = d.pop('attention', 'document')
        with gather:
            if attention not in ('document', 'causal'):
                raise ModelConfigError(f"{where}.attention: {attention!r}; allowed: document, causal")
        peft, peft_config = None, d.pop('peft_config', None)
        if peft_config is not None:
            with gather:
                peft = read_peft_config(peft_config, f'{where}.peft_config')
        attn = d.pop('attn_implementation', None)
        fused = d.pop('fused_loss', False)
        with gather:
            fused = _read_fused_loss(fused, str(model_type or ''), peft, where)
        with gather:
            if attn is not None and attn not in AttnImplementation.__args__:
                raise ModelConfigError(f"{where}.attn_implementation: {attn!r}; allowed: "
                                       f"{', '.join(AttnImplementation.__args__)}")
        trained = False
        if model_type:
            with gather:  # one line for a type not trained here, nothing more about it
                check_model_type(str(model_type), where)
                trained = True
        if trained:
            with gather:
                check_config_keys(str(model_type), d, where)
            with gather:
                check_config_keys(str(model_type), overrides, f'{where}.config_overrides')
            with gather:
                attn = check_attention(str(model_type), attention, attn, where)
        gather.raise_any()
        return cls(model_type=str(model_type), attention=attention, config_kwargs={**d, **overrides},
                   pretrained=pretrained, load_weights=load_weights, attn_implementation=attn, peft=peft,
                   fused_loss=fused)


#: model types whose logits are ``hidden @ lm_head.weight.T`` and nothing more, checked against
#: transformers' own loss (:mod:`foundrymix.train.fused_loss`)
FUSED_TYPES = ('llama', 'mistral', 'qwen2', 'qwen3')


def _read_fused_loss(value: Any, model_type: str, peft: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ModelConfigError(f'{where}.fused_loss: {value!r}; write true or false', path=f'{where}.fused_loss')
    if value and model_type and model_type not in FUSED_TYPES:
        raise ModelConfigError(f"{where}.fused_loss: not checked for a {model_type!r} model (its head may scale "
                               f"or cap the logits); it works for {', '.join(FUSED_TYPES)}: leave fused_loss out",
                               path=f'{where}.fused_loss')
    if value and peft is not None:
        raise ModelConfigError(f'{where}.fused_loss: not with peft_config (LoRA); leave fused_loss out',
                               path=f'{where}.fused_loss')
    return value


#: LLM-Foundry's ``model.name`` -> the transformers ``model_type`` that builds the same kind of model
_FOUNDRY_NAMES = {'mpt_causal_lm': 'mpt', 'hf_causal_lm': 'the model_type of its pretrained_model_name_or_path'}

#: model types named in the refusal of ``attention: document`` (each checked with :func:`reads_position_ids`)
DOCUMENT_TYPES = ('llama', 'mistral', 'qwen2', 'qwen3', 'gemma', 'gemma2', 'phi3', 'gpt2', 'gpt_neox', 'olmo')


def _modeling_source(model_type: str) -> str:
    """The source text of transformers' causal-LM module for ``model_type`` ('' when it has none);
    read, not imported (slow), since ``plan`` reads the model section too."""

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    spec = None
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        with contextlib.suppress(ImportError):
            spec = importlib.util.find_spec(f'transformers.models.{model_type}.modeling_{model_type}')
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return ''
    with open(spec.origin, encoding='utf-8') as f:
        return f.read()


@functools.lru_cache(maxsize=32)
def reads_position_ids(model_type: str) -> bool:
    """Does ``model_type``'s causal LM turn restarting ``position_ids`` into a per-document mask
    (``create_causal_mask``)? MPT, Bloom, OPT, Falcon, GPT-Neo do not: they attend across documents."""
    source = _modeling_source(model_type)
    return 'create_causal_mask' in source and 'position_ids' in source


@functools.lru_cache(maxsize=32)
def has_sdpa(model_type: str) -> bool:
    """Does ``model_type``'s causal LM declare sdpa attention (read from its modeling source)? Without
    it (GPT-Neo, MPT, GPT-J, Bloom) building it with sdpa raises, so a run uses eager."""
    return '_supports_sdpa = True' in _modeling_source(model_type)


def check_model_type(model_type: str, where: str) -> None:
    """Refuse an encoder-decoder type (T5, BART): transformers has no causal LM for it, or one
    that is its decoder alone, a different model."""
    from transformers import CONFIG_MAPPING
    if model_type in CONFIG_MAPPING and getattr(CONFIG_MAPPING[model_type](), 'is_encoder_decoder', False):
        raise ModelConfigError(f"{where}: {model_type!r} is an encoder-decoder model; foundrymix trains decoder-only "
                               f"causal LMs (llama, gpt2, mpt, ...): keep this run on LLM-Foundry",
                               path=f'{where}.type')


def check_attention(model_type: str, attention: str, attn: Optional[str], where: str) -> Optional[str]:
    """Refuse ``attention: document`` for a model that ignores ``position_ids`` (it would train
    with cross-document attention, silently), and pick ``eager`` for a model without sdpa
    (GPT-Neo, MPT: building it with sdpa raises); MPT has eager attention only."""
    if not has_sdpa(model_type):
        if attn == 'sdpa' or (model_type == 'mpt' and attn not in (None, 'eager')):
            what = "MPT has only eager" if model_type == 'mpt' else f"{model_type!r} has no sdpa"
            raise ModelConfigError(f"{where}.attn_implementation: {attn!r}: transformers' {what} attention; leave "
                                   f"attn_implementation out (eager is used) or write eager",
                                   path=f'{where}.attn_implementation')
        attn = attn or 'eager'
    if attention == 'document' and not reads_position_ids(model_type):
        works = ', '.join(t for t in DOCUMENT_TYPES if reads_position_ids(t))
        raise ModelConfigError(f"{where}.attention: document needs a model that builds its mask from "
                               f"position_ids; transformers' {model_type!r} ignores them (tokens would "
                               f"attend across documents): write attention: causal, or use a model "
                               f"type that does ({works})", path=f'{where}.attention')
    return attn


def _read_pretrained(d: dict[str, Any], where: str) -> tuple[Optional[str], bool]:
    """(model directory, load its weights?) from ``pretrained`` or LLM-Foundry's spelling."""
    value = d.pop('pretrained', None)
    name = d.pop('pretrained_model_name_or_path', None)
    if name is not None:  # LLM-Foundry: the path here, ``pretrained`` a bool
        if not isinstance(value, (bool, type(None))):
            raise ModelConfigError(f'{where}.pretrained: with pretrained_model_name_or_path it is true '
                                   f'(load the weights) or false (config only), got {value!r}')
        path, load = str(name), value is not False
        key = f'{where}.pretrained_model_name_or_path'
    elif value is None or value is False:
        return None, False
    elif value is True:
        raise ModelConfigError(f'{where}.pretrained: true needs pretrained_model_name_or_path; or write '
                               f'pretrained: /path/to/model_dir')
    else:
        path, load, key = str(value), True, f'{where}.pretrained'
    if not os.path.isfile(os.path.join(path, 'config.json')):
        raise ModelConfigError(f'{key}: {path}: not a local Hugging Face model directory (no config.json; '
                               f'models are never downloaded)')
    return path, load


def _pretrained_type(path: str, model_type: Any, where: str) -> str:
    with open(os.path.join(path, 'config.json'), encoding='utf-8') as f:
        saved = json.load(f).get('model_type')
    if not saved:
        raise ModelConfigError(f'{where}.pretrained: {path}/config.json names no model_type')
    if model_type and model_type != saved:
        raise ModelConfigError(f'{where}.type: {model_type!r}, but {path} holds a {saved!r} model')
    return saved


@functools.lru_cache(maxsize=16)
def config_keys(model_type: str) -> frozenset[str]:
    """Every key the transformers config class of ``model_type`` understands."""
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    params = [p.name for p in inspect.signature(config_cls.__init__).parameters.values()
              if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != 'self']
    attrs = [k for k in vars(config_cls()) if not k.startswith('_')]
    return frozenset([*params, *attrs, *getattr(config_cls, 'attribute_map', {})])


def check_config_keys(model_type: str, kwargs: Mapping[str, Any], where: str) -> None:
    """Refuse a key the config class of ``model_type`` does not know, naming the nearest."""
    try:
        valid = config_keys(model_type)
    except KeyError:
        from transformers import CONFIG_MAPPING
        near = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ''
        raise ModelConfigError(f'{where}.type: {model_type!r} is not a transformers model_type{hint}') from None
    gather = Gather()
    for key in kwargs:
        if key not in valid:
            advice = foundry_model_advice(key, model_type) or foundry_advice(f'model.{key}')
            near = difflib.get_close_matches(key, sorted(valid) + list(OWN_KEYS), n=1)
            hint = f'; {advice}' if advice else f"; did you mean {near[0]!r}?" if near else ''
            gather.add(ModelConfigError(f'{where}.{key}: unknown key for a {model_type!r} model '
                                        f'(transformers {model_type} config){hint}'))
    gather.raise_any()


def hf_config(spec: ModelSpec, tokenizer: Any) -> Any:
    """The transformers config: the pretrained directory's, or ``type``'s defaults, plus overrides
    (here, not with the model, which imports Composer: ``plan`` builds it too)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    kwargs = dict(spec.config_kwargs)
    if spec.pretrained is None:  # token ids from the streams' tokenizer unless the YAML says
        kwargs.setdefault('vocab_size', tokenizer.vocab_size)
        kwargs.setdefault('eos_token_id', tokenizer.eos_id)
        kwargs.setdefault('pad_token_id', tokenizer.pad_id)
        if tokenizer.bos_id is not None:
            kwargs.setdefault('bos_token_id', tokenizer.bos_id)
    kwargs.setdefault('use_cache', False)
    try:
        if spec.pretrained is not None:
            return AutoConfig.from_pretrained(spec.pretrained, local_files_only=True, **kwargs)
        return AutoConfig.for_model(spec.model_type, **kwargs)
    except (ValueError, TypeError, OSError, StrictDataclassError) as e:
        # transformers 5 validates a config when it is built (huggingface_hub's strict dataclasses): the
        # last line of its message is the reason
        raise ModelConfigError(f"model: {str(e).strip().splitlines()[-1].strip().removeprefix('ValueError: ')}"
                               ) from None

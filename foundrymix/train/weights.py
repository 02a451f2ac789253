"""A pretrained directory checked against the model and the streams before it loads (transformers'
tracebacks name neither ``model.pretrained`` nor the fix). Shapes come from safetensors headers and
a ``meta`` model, so it takes moments; no Composer (``foundrymix plan`` runs these checks too).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from foundrymix.config import ConfigError
from foundrymix.train.lora import check_targets
from foundrymix.train.model_spec import ModelConfigError, ModelSpec, hf_config
from foundrymix.format.schema import changed_tokenizer_note, tokenizer_differences
from foundrymix.tokenizer import TokenizerError, load_tokenizer, tokenizer_info

#: the files transformers loads PyTorch weights from (``transformers.utils`` names them alike)
WEIGHT_FILES = ('model.safetensors', 'model.safetensors.index.json', 'pytorch_model.bin',
                'pytorch_model.bin.index.json')
#: differing tensors a refusal names before '... and K more'
NAMED = 3
#: vocab padding that still counts as "the same vocabulary" when a model directory has no tokenizer
VOCAB_PAD = 128


def check_has_weights(spec: ModelSpec) -> None:
    """A ``pretrained`` directory whose weights are to be loaded holds a weights file."""
    if spec.pretrained is None or not spec.load_weights or not os.path.isdir(spec.pretrained):
        return
    if not any(os.path.exists(os.path.join(spec.pretrained, name)) for name in WEIGHT_FILES):
        raise ModelConfigError(
            f'model.pretrained: {spec.pretrained} holds no weights (none of {", ".join(WEIGHT_FILES)}): '
            f'save the model there with save_pretrained, or, to start from its config with random '
            f'weights, write model: {{pretrained_model_name_or_path: {spec.pretrained}, pretrained: false}}')


def safetensors_files(directory: str) -> list[str]:
    """The paths of a model directory's safetensors weight files (sharded or one), [] if none."""
    index = os.path.join(directory, 'model.safetensors.index.json')
    if os.path.exists(index):
        with open(index, encoding='utf-8') as f:
            files = sorted(set(json.load(f).get('weight_map', {}).values()))
    elif os.path.exists(os.path.join(directory, 'model.safetensors')):
        files = ['model.safetensors']
    else:
        return []
    return [os.path.join(directory, name) for name in files]


def meta_model(config: Any) -> Any:
    """The causal LM of ``config`` on the ``meta`` device (no memory, no init), or None when
    transformers cannot build it (not a causal LM, ...: the load's own refusal says so)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device('meta'):
            return AutoModelForCausalLM.from_config(copy.deepcopy(config))
    except (ValueError, ImportError):
        return None


def check_weight_shapes(spec: ModelSpec, config: Any) -> None:
    """Every safetensors file of the pretrained directory opens (else it is named: transformers' own
    error names none) and holds each tensor in the shape the model built from ``config`` gives it."""
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[str, list[int]]] = {}  # tensor name -> (file, shape)
    try:
        for path in safetensors_files(spec.pretrained):
            with safe_open(path, 'pt') as h:
                shapes.update((key, (path, list(h.get_slice(key).get_shape()))) for key in h.keys())
    except SafetensorError as e:
        raise ModelConfigError(f'model.pretrained: {path}: not a whole safetensors file ({e}); a truncated '
                               f'copy? Copy or save the model again') from None
    except Exception:  # noqa: BLE001 -- a missing shard, a broken index: the load's own refusal names it
        return
    model = meta_model(config) if shapes else None
    if model is None:
        return
    prefix = getattr(model, 'base_model_prefix', '')
    wanted = {k: list(v.shape) for k, v in model.state_dict().items()}
    differ = []
    for key, (path, shape) in shapes.items():
        want = wanted.get(key, wanted.get(f'{prefix}.{key}'))
        if want is not None and want != shape:
            differ.append((key, path, shape, want))
    if not differ:
        return
    key, path, shape, want = differ[0]
    more = ', '.join(d[0] for d in differ[1:NAMED + 1]) + (f' ... and {len(differ) - NAMED - 1} more'
                                                          if len(differ) > NAMED + 1 else '')
    yaml_keys = sorted(k for k in spec.config_kwargs if k != 'use_cache')
    source = os.path.join(spec.pretrained, 'config.json')
    if yaml_keys:
        source += ' with ' + ', '.join(f'model.{k}={spec.config_kwargs[k]}' for k in yaml_keys)
        fix = (f'leave out the model keys that change sizes ({", ".join(f"model.{k}" for k in yaml_keys)}): '
               f'pretrained weights keep the sizes they were saved with')
    else:
        fix = 'the config.json beside the weights is not theirs: save model and config together (save_pretrained)'
    raise ModelConfigError(
        f'model.pretrained: {path} holds {key} of shape {shape}, but the model of {source} needs '
        f'{want}' + (f' (also differ: {more})' if more else '') + f'; {fix}')


def check_pretrained_tokenizer(spec: ModelSpec, streams: Any) -> None:
    """Refuse streams tokenized with another vocabulary than the pretrained model's: equal fingerprints
    with the directory's tokenizer; without one, its ``vocab_size`` padded by < ``VOCAB_PAD``."""
    if spec.pretrained is None:
        return

    try:
        model_tok = tokenizer_info(load_tokenizer(spec.pretrained))
    except TokenizerError:
        model_tok = None
    if model_tok is not None:
        if model_tok.fingerprint != streams.fingerprint:
            raise ModelConfigError(
                f'model.pretrained: {spec.pretrained} has another tokenizer than the streams ({streams.name}): '
                f"{tokenizer_differences(model_tok, streams)} (the directory's vs the streams')"
                f'{changed_tokenizer_note(spec.pretrained, streams)}')
        return
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(spec.pretrained, local_files_only=True).vocab_size
    if not 0 <= vocab - streams.vocab_size < VOCAB_PAD:
        raise ModelConfigError(
            f'model.pretrained: {spec.pretrained} (no tokenizer) has vocab_size={vocab}, the streams\' '
            f'tokenizer {streams.name} has {streams.vocab_size} tokens: another vocabulary')


def check_spec_targets(spec: Any, tokenizer: Any) -> None:
    """:func:`~foundrymix.train.lora.check_targets` on the model ``spec`` describes, built on the ``meta`` device, so
    ``plan`` refuses what ``train`` would; a model that cannot be built is left to ``train``."""
    try:
        model = meta_model(hf_config(spec, tokenizer))
    except ConfigError:
        return
    if model is not None:
        check_targets(model, spec.peft)

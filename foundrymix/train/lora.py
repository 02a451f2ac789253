"""LoRA finetuning through the optional ``peft`` library: ``model.peft_config`` as LLM-Foundry reads
it; only the adapter (and any ``modules_to_save``) trains. Checked here: peft accepts a
``target_modules`` entry that matches nothing beside one that does (a misspelt ``q_prj`` trains
only ``v_proj``, in silence), and an unknown key is a ``TypeError`` traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import re
from typing import Any, Mapping

from foundrymix.config import ConfigError, Gather, to_plain

INSTALL = "pip install 'foundrymix[peft]'"
#: LoraConfig fields that are peft's bookkeeping, not settings of a run
_MANAGED = {'peft_type': 'only LORA', 'task_type': 'only CAUSAL_LM',
            'base_model_name_or_path': 'the base is model.pretrained',
            'inference_mode': 'a run trains the adapter', 'auto_mapping': None, 'peft_version': None,
            'revision': 'models are local directories'}
#: ``init_lora_weights`` values that leave the base weights as they are and need no data
_INITS = (True, False, 'gaussian')


def peft_available() -> bool:
    return importlib.util.find_spec('peft') is not None


def read_peft_config(value: Any, where: str) -> dict[str, Any]:
    """``model.peft_config`` as plain ``LoraConfig`` keyword arguments (``task_type`` included),
    every problem refused at once, each naming its key."""
    d = to_plain(value, where)
    if not peft_available():
        raise ConfigError(f'{where}: LoRA needs the peft library, which is not installed: {INSTALL}', path=where)
    gather = Gather()
    peft_type = d.pop('peft_type', 'LORA')
    if str(peft_type).upper() != 'LORA':
        gather.add(ConfigError(f'{where}.peft_type: {peft_type!r}: only LORA is supported (as in LLM-Foundry)'))
    task_type = d.pop('task_type', 'CAUSAL_LM')
    if str(task_type).upper() != 'CAUSAL_LM':
        gather.add(ConfigError(f'{where}.task_type: {task_type!r}: only CAUSAL_LM is supported (a causal LM '
                               f'trains here)'))
    from peft import LoraConfig
    valid = sorted(f.name for f in dataclasses.fields(LoraConfig) if f.init and f.name not in _MANAGED)
    for key in list(d):
        if key in valid:
            continue
        d.pop(key)
        if key in _MANAGED:
            why = _MANAGED[key] or "set by peft itself"
            gather.add(ConfigError(f'{where}.{key}: not a setting here ({why}); delete it'))
            continue
        near = difflib.get_close_matches(key, valid, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ''
        gather.add(ConfigError(f"{where}.{key}: unknown key of peft's LoraConfig; {hint}"
                               f"its keys: {', '.join(valid)}"))
    init = d.get('init_lora_weights', True)
    if init not in _INITS:
        gather.add(ConfigError(f'{where}.init_lora_weights: {init!r}: not supported here (it changes the base '
                               f'weights or needs data before training); use true, false or gaussian'))
    gather.raise_any()
    out = {**d, 'task_type': 'CAUSAL_LM'}
    try:
        lora_config(out)
    except (ValueError, TypeError) as e:
        raise ConfigError(f'{where}: {" ".join(str(e).split())}', path=where) from None
    return out


def lora_config(peft: Mapping[str, Any]) -> Any:
    from peft import LoraConfig
    return LoraConfig(**dict(peft))


# ----------------------------------------------------------------------------- the model

def _adaptable() -> tuple[type, ...]:
    """Module kinds peft's LoRA adapts."""
    import torch
    from transformers.pytorch_utils import Conv1D
    return (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, Conv1D)


def _matches(name: str, target: str) -> bool:
    """peft's rule for a list entry: the module's full name, or its name after a dot."""
    return name == target or name.endswith('.' + target)


def _short_names(names: list[str]) -> str:
    """The distinct last parts of module names, in the model's order (a layer's index left out)."""
    return ', '.join(dict.fromkeys(n.rsplit('.', 1)[-1] for n in names if not n.rsplit('.', 1)[-1].isdigit()))


def check_targets(model: Any, peft: Mapping[str, Any]) -> None:
    """Every ``target_modules`` entry (or the regex) matches a module LoRA can adapt, and every
    ``modules_to_save`` entry a module of ``model``; a refusal lists the names to choose from."""
    adaptable = [n for n, m in model.named_modules() if n and isinstance(m, _adaptable())]
    every = [n for n, _ in model.named_modules() if n]
    kind = getattr(getattr(model, 'config', None), 'model_type', 'this')
    gather, where = Gather(), 'model.peft_config'
    targets = peft.get('target_modules')
    if isinstance(targets, str) and targets != 'all-linear':
        if not any(re.fullmatch(targets, n) for n in adaptable):
            gather.add(ConfigError(
                f'{where}.target_modules: {targets!r} (a regex, matched against full module names) matches no '
                f'layer of the {kind} model that LoRA can adapt; its layers: {_short_names(adaptable)} '
                f'(full names such as {adaptable[0] if adaptable else "-"})'))
    elif isinstance(targets, (list, tuple)):
        for t in targets:
            if not any(_matches(n, str(t)) for n in adaptable):
                gather.add(ConfigError(
                    f'{where}.target_modules: {t!r} matches no layer of the {kind} model that LoRA can '
                    f'adapt; choose from its layers: {_short_names(adaptable)}'))
    for t in peft.get('modules_to_save') or []:
        if not any(_matches(n, str(t)) for n in every):
            gather.add(ConfigError(f'{where}.modules_to_save: {t!r} matches no module of the {kind} model; '
                                   f'choose from: {_short_names(every)}'))
    gather.raise_any()


def wrap(model: Any, peft: Mapping[str, Any]) -> Any:
    """``model`` as a peft LoRA model (base frozen, adapter from torch's RNG) carrying
    :func:`trainable_line` as ``foundrymix_lora``."""
    from peft import get_peft_model

    check_targets(model, peft)
    try:
        wrapped = get_peft_model(model, lora_config(peft))
    except ValueError as e:  # e.g. no target_modules and no default for this model type
        kind = getattr(model.config, 'model_type', 'this')
        layers = [n for n, m in model.named_modules() if n and isinstance(m, _adaptable())]
        if peft.get('target_modules') is None:
            raise ConfigError(f'model.peft_config.target_modules: missing, and peft has no default for a {kind} '
                              f'model: give the layers to adapt, from: {_short_names(layers)}') from None
        raise ConfigError(f'model.peft_config: {" ".join(str(e).split())} (the layers of the {kind} model LoRA can '
                          f'adapt: {_short_names(layers)})', path='model.peft_config') from None
    wrapped.foundrymix_lora = trainable_line(wrapped, peft)
    return wrapped


def trainable_line(model: Any, peft: Mapping[str, Any]) -> str:
    """``model: LoRA r=8 on q_proj, v_proj (2 layers): 1,024 of 123,456 parameters train (0.83 %)``."""
    total = sum(p.numel() for p in model.parameters())
    train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    from peft.tuners.lora import LoraLayer
    layers = [n for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    save = peft.get('modules_to_save')
    extra = f', modules_to_save {", ".join(map(str, save))} train whole' if save else ''
    return (f'model: LoRA r={peft.get("r", 8)} on {_short_names(layers)} ({len(layers)} layers{extra}): '
            f'{train:,} of {total:,} parameters train ({100 * train / total:.2f} %); the others are frozen')

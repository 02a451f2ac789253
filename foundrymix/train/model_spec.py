"""The ``model`` section of a training YAML, read without torch (see :mod:`foundrymix.train.model`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

AttentionMode = Literal['document', 'causal']


class ModelConfigError(ValueError):
    """The ``model`` section does not describe a causal LM that fits the data."""


@dataclass
class ModelSpec:
    """The ``model`` section: a transformers ``model_type`` plus its config fields."""

    model_type: str
    attention: AttentionMode
    config_kwargs: dict[str, Any]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> 'ModelSpec':
        d = dict(d)
        model_type = d.pop('type', None) or d.pop('model_type', None)
        if not model_type:
            raise ModelConfigError("model: needs 'type' (a transformers model_type such as llama or gpt2)")
        attention = d.pop('attention', 'document')
        if attention not in ('document', 'causal'):
            raise ModelConfigError(f"model.attention: {attention!r}; allowed: document, causal")
        return cls(model_type=str(model_type), attention=attention, config_kwargs=d)

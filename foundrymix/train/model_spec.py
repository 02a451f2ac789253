"""The ``model`` section of a training YAML, read without torch (see :mod:`foundrymix.train.model`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from foundrymix.config import ConfigError, to_plain

AttentionMode = Literal['document', 'causal']


class ModelConfigError(ConfigError):
    """The ``model`` section does not describe a causal LM that fits the data."""


@dataclass
class ModelSpec:
    """The ``model`` section: a transformers ``model_type`` plus its config fields.

    Read with :meth:`from_config` (the config reader calls it): ``type`` (or
    ``model_type``) and ``attention`` are ours, every other key is handed to the
    transformers config of that type.
    """

    model_type: str
    attention: AttentionMode
    config_kwargs: dict[str, Any]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> 'ModelSpec':
        return cls.from_config(d, 'model')

    @classmethod
    def from_config(cls, value: Any, where: str) -> 'ModelSpec':
        d = to_plain(value, where)
        model_type = d.pop('type', None) or d.pop('model_type', None)
        if not model_type:
            raise ModelConfigError(f"{where}: needs 'type' (a transformers model_type such as "
                                   f"llama or gpt2)")
        attention = d.pop('attention', 'document')
        if attention not in ('document', 'causal'):
            raise ModelConfigError(f"{where}.attention: {attention!r}; allowed: document, causal")
        return cls(model_type=str(model_type), attention=attention, config_kwargs=d)

"""The data part of a run's YAML -- what a loader needs -- read and checked without the trainer
(no torch imported). The trainer's ``TrainConfig`` extends :class:`DataConfig`, so the data keys
of every YAML are read by one class and refused alike."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from foundrymix.config import ConfigError, Duration, blame, load_yaml_overrides, read_dataclass, read_value
from foundrymix.plan.config import LoaderConfig, cache_base
from foundrymix.format.schema import changed_tokenizer_note, tokenizer_differences
from foundrymix.tokenizer import describe_tokenizer


class TokenizerName(str):
    """``tokenizer``: the name the streams were converted with (checked against their
    fingerprint before training)."""

    @classmethod
    def from_config(cls, value: Any, where: str) -> 'TokenizerName':
        if isinstance(value, Mapping):  # LLM-Foundry: {name: ..., kwargs: {...}}
            name = value.get('name')
            raise ConfigError(f"{where}: LLM-Foundry's {{name: ..., kwargs: ...}} is {where}: "
                              f"{name or 'NAME'} here (kwargs such as model_max_length have no "
                              f"equivalent: max_seq_len and the streams decide)")
        return cls(read_value(value, str, where))


@dataclass(kw_only=True)
class DataConfig:
    """The data keys of a run's YAML (``variables`` is resolved and dropped); every key is
    checked as it is read."""

    train_loader: LoaderConfig
    global_train_batch_size: int
    #: may be left out with ``train_loader.stages`` (the run is then the sum of the stages)
    max_duration: Optional[Duration] = None
    #: the rows' length; a data-only YAML may leave it to the streams
    max_seq_len: Optional[int] = None
    tokenizer: Optional[TokenizerName] = None
    eval_loader: Optional[LoaderConfig] = None
    #: the run's seed, which the trainer seeds with (the sample order is ``shuffle_seed``'s)
    seed: int = 17

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Any:
        d = dict(d)
        d.pop('variables', None)
        cfg = read_dataclass(cls, d)
        for loader in (cfg.train_loader, cfg.eval_loader):  # LLM-Foundry token shards read in place
            if cfg.tokenizer and loader is not None and loader.tokenizer is None:
                loader.tokenizer = str(cfg.tokenizer)
        return cfg

    @classmethod
    def from_run(cls, d: Mapping[str, Any]) -> 'DataConfig':
        """A YAML with ``model:`` is a training YAML: its data keys are read here, the others
        left to the trainer; any other YAML is data-only, every key checked."""
        if 'model' not in d:
            return cls.from_dict(d)
        return cls.from_dict({k: v for k, v in d.items() if k in DATA_KEYS})

    def check(self, where: str) -> None:
        if self.global_train_batch_size <= 0:
            raise ConfigError('global_train_batch_size must be positive')
        if self.max_duration is None and self.train_loader.stages is None:
            raise ConfigError("config: missing required key 'max_duration' (it may be left out "
                              "only with train_loader.stages: the run is then the sum of the stages)")


#: the keys a data-only YAML may hold (no model, optimizer, loggers, ...)
DATA_KEYS = frozenset(f.name for f in dataclasses.fields(DataConfig)) | {'variables'}


def read_yaml_config(path: str, overrides: Sequence[str], max_duration: Optional[str],
                     read: Callable[[dict[str, Any]], Any]) -> Any:
    """Load a YAML, apply ``key=value`` overrides and ``max_duration``, and type it with ``read``;
    a problem is blamed on its override or the file, so every command refuses a YAML alike."""
    data, applied = load_yaml_overrides(path, overrides)
    if max_duration is not None:
        data['max_duration'] = max_duration
    try:
        return read(data)
    except ConfigError as e:
        raise blame(e, path, applied, data) from None


def run_batches(cfg: DataConfig) -> list[tuple[str, int]]:
    """(key, global batch) of every global batch the run trains: the run's (unless every stage
    sets its own) and each stage's own ``global_train_batch_size``."""
    stages = cfg.train_loader.stages or []
    gbs = cfg.global_train_batch_size
    used = [('', gbs)] if not stages or any(s.global_train_batch_size is None for s in stages) else []
    return used + [(f'{s.where}.global_train_batch_size ', s.global_train_batch_size) for s in stages
                   if s.global_train_batch_size is not None]


def batch_per_rank(cfg: DataConfig, world_size: int) -> int:
    """Rows per rank of each global batch on ``world_size`` ranks; refuses a global batch the
    ranks cannot split, before any rank is launched."""
    for key, g in [('', cfg.global_train_batch_size)] + run_batches(cfg):
        if g % world_size:
            raise ConfigError(f'{key.strip() or "global_train_batch_size"}={g} is not divisible by '
                              f'the {world_size} ranks')
    return cfg.global_train_batch_size // world_size


def check_data_streams(cfg: DataConfig, max_seq_len: int, tokenizer: Any) -> None:
    """The train streams' rows must be ``max_seq_len`` long and from ``cfg.tokenizer``
    (``tokenizer``: the streams' ``TokenizerInfo``)."""
    if cfg.max_seq_len is not None and cfg.max_seq_len != max_seq_len:  # data-only: may be left out
        raise ConfigError(f'max_seq_len={cfg.max_seq_len}, but the train streams hold rows of '
                          f'{max_seq_len} tokens')
    if cfg.tokenizer is not None:
        memo = os.path.join(cache_base(cfg.train_loader.cache_root), 'tokenizers')
        have = describe_tokenizer(cfg.tokenizer, memo)
        if have.fingerprint != tokenizer.fingerprint:
            raise ConfigError(f'tokenizer {cfg.tokenizer!r} differs from the one the streams were '
                              f'converted with ({tokenizer.name}): {tokenizer_differences(have, tokenizer)} '
                              f"(this one vs the streams'){changed_tokenizer_note(cfg.tokenizer, tokenizer)}")


def check_eval_catalog(catalog: Any, max_seq_len: int, tokenizer: Any) -> None:
    """The ``eval_loader``'s streams (``catalog``, a :class:`~foundrymix.plan.catalog.Catalog`)
    validated (by reading its ``max_seq_len``) and holding rows like the train streams'."""
    if catalog.max_seq_len != max_seq_len or catalog.tokenizer.fingerprint != tokenizer.fingerprint:
        raise ConfigError(f'eval_loader.streams: rows of max_seq_len {catalog.max_seq_len} from tokenizer '
                          f'{catalog.tokenizer.name}, but the train streams\' are {max_seq_len} from '
                          f'{tokenizer.name}: evaluate on data converted like the training data')

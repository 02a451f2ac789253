"""The one config layer: YAML loading, a strict typed reader, and the one ``ConfigError``.

Why strict: a misspelt key (``repaet: 2``) silently dropped means a run trains on the
wrong mixture for days, and a value of the wrong type that slips through fails hours
later inside a library. So every config section of foundrymix is a dataclass, and
:func:`read_dataclass` turns a plain mapping into it, checking *every* annotation it
meets -- ``int``, ``float``, ``bool``, ``str``, ``Optional``/unions, ``Literal``
choices, ``list``, ``tuple``, ``dict`` and nested dataclasses -- from
``typing.get_type_hints`` (real types, not annotation text), and naming the full key
path (``train_loader.streams.arxiv.repeat``) in every error.

omegaconf does what it is good at: YAML, ``${variables.x}`` interpolation and
``key=value`` overrides (:func:`load_yaml`). This module imports neither torch nor
composer, so reading a config (``foundrymix plan``) stays fast.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from typing import Any, Literal, Mapping, Optional, Sequence, Union, get_args, get_origin

from foundrymix.errors import FoundrymixError, MissingError


class ConfigError(FoundrymixError, ValueError):
    """A config cannot run; the message names the offending key path (and file)."""


# ----------------------------------------------------------------------------- YAML
#: ``--help`` of the ``key=value`` arguments of ``train`` and ``plan`` (see :func:`load_yaml`)
OVERRIDES_HELP = ('key=value overrides of the YAML (omegaconf dotlist, e.g. train_loader.shuffle_seed=3); '
                  'a mapping or list value ({...}, [...]) replaces the YAML\'s value at that key, '
                  'it is not merged into it')


#: what omegaconf 2.4 lets YAML aliases add beyond what a file spells out (its own default)
ALIAS_NODE_ALLOWANCE = 10_000


def _omegaconf_load(path: str) -> Any:
    """``OmegaConf.load(path)`` without omegaconf's absolute node limit on plain YAML.

    Why: omegaconf 2.4.0 refuses any document that expands to more than 10,000 nodes
    (``max_yaml_expanded_nodes``, a guard against alias bombs), and a plain mix of 10,000
    streams -- no alias in it -- has ~40,000 (measured: "YAML node expansion exceeds the
    configured limit of 10000"). A file of N bytes spells out at most N nodes, so the limit
    becomes N + 10,000: what the file writes is never refused, aliases may still add
    10,000 nodes, and omegaconf's ratio guard (expanded vs unique nodes, 100x) stays on.
    An explicit ``OMEGACONF_MAX_YAML_EXPANDED_NODES`` is respected; omegaconf < 2.4 has
    no limit to raise.
    """
    import inspect

    from omegaconf import OmegaConf
    if ('max_yaml_expanded_nodes' not in inspect.signature(OmegaConf.load).parameters
            or 'OMEGACONF_MAX_YAML_EXPANDED_NODES' in os.environ):
        return OmegaConf.load(path)
    limit = os.path.getsize(path) + ALIAS_NODE_ALLOWANCE
    return OmegaConf.load(path, max_yaml_expanded_nodes=limit)


def load_yaml(path: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Load ``path`` with omegaconf, apply ``key=value`` overrides, resolve interpolations.

    A scalar value sets that one key. A mapping or list value (``train_loader.streams={a:
    {local: /d}}``) *replaces* the YAML's value at that key: whoever types a whole mapping
    means that mapping; merging it into the YAML's (omegaconf's ``update(merge=True)``, the
    default until issue 27) kept every stream the YAML had besides, silently. Hydra's
    ``+key=value`` (add a key) is accepted as the plain ``key=value``: the typed reader
    decides whether the key exists.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not os.path.isfile(path):
        raise MissingError(f'{path}: no such config file')
    pairs = []
    for item in overrides:
        if '=' not in item:
            raise ConfigError(f'override {item!r} is not key=value')
        key, value = item.split('=', 1)
        pairs.append((key[1:] if key.startswith('+') else key, value))
    try:
        cfg = _omegaconf_load(path)
        for key, value in pairs:
            # omegaconf's own value grammar (lists, mappings, ${...}); update() also walks
            # into lists (``train_loader.stages.0.duration=10ba``), which merging a dotlist can't
            parsed = OmegaConf.to_container(OmegaConf.from_dotlist([f'_={value}']), resolve=False)['_']
            try:
                OmegaConf.update(cfg, key, parsed, merge=not isinstance(parsed, (dict, list)),
                                 force_add=True)
            except (OmegaConfBaseException, TypeError, ValueError, IndexError) as e:
                raise ConfigError(f'override {key}={value}: {e}') from None
        data = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f'{path}: {type(e).__name__}: {e}') from None
    except Exception as e:  # yaml.YAMLError and friends
        if type(e).__module__.startswith('yaml'):
            raise ConfigError(f'{path}: not valid YAML: {e}') from None
        raise
    if not isinstance(data, dict):
        raise ConfigError(f'{path}: expected a mapping at the top level')
    return data


def to_plain(d: Any, where: str) -> dict[str, Any]:
    """A plain ``dict`` from a mapping or an omegaconf ``DictConfig`` (resolved)."""
    if type(d).__name__ == 'DictConfig':
        from omegaconf import OmegaConf
        d = OmegaConf.to_container(d, resolve=True)
    if d is None:
        return {}
    if not isinstance(d, Mapping):
        raise ConfigError(f'{where}: must be a mapping, got {d!r}')
    return dict(d)


def check_keys(d: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    """Refuse keys not in ``allowed``, naming the key and every allowed one."""
    for key in d:
        if key not in allowed:
            raise ConfigError(f'{where or "config"}: unknown key {key!r}; allowed: '
                              f'{", ".join(allowed)}')


def join(where: str, key: str) -> str:
    """The key path of ``key`` inside section ``where`` (``''`` is the top level)."""
    return f'{where}.{key}' if where else key


# ----------------------------------------------------------------------------- values
_ABBREV = {'k': 10**3, 'm': 10**6, 'b': 10**9, 't': 10**12}


def number_abbrev_to_int(text: str) -> int:
    """``'2k'`` -> 2000 as streaming reads ``epoch_size`` (k, m, b, t), without importing it."""
    s = text.strip().lower()
    if s and s[-1] in _ABBREV:
        return int(float(s[:-1]) * _ABBREV[s[-1]])
    if s.isdigit():
        return int(s)
    raise ValueError(text)


DURATION_UNITS = {'ep': 'epochs', 'ba': 'batches', 'sp': 'samples', 'tok': 'tokens'}


def parse_duration(text: Any, where: str = 'max_duration') -> tuple[int, str]:
    """Parse a Composer time string (``100ba``, ``5000sp``, ``1000000tok``, ``3ep``).

    A bare int is read as epochs, as Composer reads it; config files must say the unit
    (:func:`check_duration`), so a plan and a run can never read one number two ways.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text, 'ep'
    m = re.fullmatch(r'\s*(\d+)\s*(ep|ba|sp|tok)\s*', str(text))
    if not m:
        raise ConfigError(f'{where}: {text!r} is not a Composer time string with a whole '
                          f'number of ep, ba, sp or tok (e.g. 3ep, 100ba, 5000sp, 1000000tok)')
    value = int(m.group(1))
    if value <= 0:
        raise ConfigError(f'{where}: must be positive, got {text!r}')
    return value, m.group(2)


def check_duration(text: Optional[str], where: str) -> None:
    """A config duration must name its unit: ``10`` could mean epochs or batches."""
    if text is None:
        return
    if re.fullmatch(r'\s*\d+\s*', text):
        raise ConfigError(f'{where}: {text!r} has no unit; write it as a Composer time string '
                          f'(e.g. {text.strip()}ep, {text.strip()}ba, 5000sp, 1000000tok)')
    parse_duration(text, where)


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return 'null'
    origin = get_origin(tp)
    if origin is Literal:
        return ' | '.join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return ' or '.join(_type_name(a) for a in get_args(tp) if a is not type(None))
    if origin is not None:
        return getattr(origin, '__name__', str(origin))
    return getattr(tp, '__name__', str(tp))


def read_value(value: Any, tp: Any, where: str) -> Any:
    """``value`` read as type ``tp``; :class:`ConfigError` naming ``where`` when it is not one."""
    if tp is Any:
        return value
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return _read_union(value, args, where)
    from_config = getattr(tp, 'from_config', None)
    if from_config is not None:  # a section with a reader of its own
        return from_config(value, where)
    if value is None:
        if dataclasses.is_dataclass(tp):
            value = {}  # an empty YAML section (``dolly:``) is an empty mapping
        elif tp is not type(None):
            raise ConfigError(f'{where}: must not be null')
    if origin is Literal:
        if value not in args:
            raise ConfigError(f'{where}: {value!r} is not one of {", ".join(map(str, args))}')
        return value
    if dataclasses.is_dataclass(tp):
        return read_dataclass(tp, value, where)
    if origin in (list, tuple, dict) or tp in (list, tuple, dict):
        return _read_container(value, tp, origin or tp, args, where)
    reader = _SCALARS.get(tp)
    if reader is None:
        raise TypeError(f'{where}: no config reader for {tp!r}')
    try:
        return reader(value)
    except (TypeError, ValueError):
        raise ConfigError(f'{where}: expected {_type_name(tp)}, got {value!r}') from None


def _read_union(value: Any, args: tuple, where: str) -> Any:
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f'{where}: must not be null')
    options = [a for a in args if a is not type(None)]
    # An exact type match wins (a str stays a str in Union[int, str]); then try in order.
    for a in options:
        if get_origin(a) is None and isinstance(a, type) and type(value) is a:
            return value
    errors = []
    for a in options:
        try:
            return read_value(value, a, where)
        except ConfigError as e:
            errors.append(e)
    if len(errors) == 1:
        raise errors[0]
    raise ConfigError(f'{where}: expected {" or ".join(_type_name(a) for a in options)}, '
                      f'got {value!r}')


def _read_container(value: Any, tp: Any, origin: Any, args: tuple, where: str) -> Any:
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f'{where}: expected a mapping, got {value!r}')
        key_tp, val_tp = args if args else (Any, Any)
        if dataclasses.is_dataclass(val_tp):  # named sections: the key is their name
            return {read_value(k, key_tp, where): read_dataclass(val_tp, v, join(where, str(k)), key=str(k))
                    for k, v in value.items()}
        return {read_value(k, key_tp, where): read_value(v, val_tp, join(where, str(k)))
                for k, v in value.items()}
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ConfigError(f'{where}: expected a list, got {value!r}')
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ConfigError(f'{where}: expected {len(args)} values, got {len(value)}')
        return tuple(read_value(v, a, f'{where}[{i}]') for i, (v, a) in enumerate(zip(value, args)))
    item_tp = args[0] if args else Any
    items = [read_value(v, item_tp, f'{where}[{i}]') for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


def _read_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ('true', 'false'):
        return value.lower() == 'true'
    raise TypeError


def _read_int(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError
    if isinstance(value, str):
        return number_abbrev_to_int(value)
    if isinstance(value, float) and not value.is_integer():
        raise TypeError
    if not isinstance(value, (int, float)):
        raise TypeError
    return int(value)


def _read_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError
    return float(value)


def _read_str(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError
    return str(value)


_SCALARS = {bool: _read_bool, int: _read_int, float: _read_float, str: _read_str}

#: field metadata: the field is filled from the mapping key the section sits under
FROM_KEY = {'from_key': True}


def read_dataclass(cls: type, data: Any, where: str = '', key: Optional[str] = None,
                   allow_extra: Sequence[str] = ()) -> Any:
    """Build dataclass ``cls`` from a mapping, checking every key and every value's type.

    Unknown keys (except ``allow_extra``) and missing required fields are errors naming
    ``where``. A field with ``metadata=FROM_KEY`` takes ``key`` (the mapping key of the
    section, e.g. a stream's name) instead of a value from ``data``. After building,
    ``cls.check(self, where)`` runs if defined: checks that need several fields.
    """
    data = to_plain(data, where)
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    settable = [f.name for f in fields if not f.metadata.get('from_key')]
    check_keys(data, settable + [k for k in allow_extra if k not in settable], where)
    kwargs: dict[str, Any] = {}
    for f in fields:
        if f.metadata.get('from_key'):
            kwargs[f.name] = key
        elif f.name in data:
            kwargs[f.name] = read_value(data[f.name], hints[f.name], join(where, f.name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f'{where or "config"}: missing required key {f.name!r}')
    obj = cls(**kwargs)
    check = getattr(obj, 'check', None)
    if callable(check):
        check(where)
    return obj


"""The strict typed reader: a plain mapping into a config dataclass, every annotation checked,
every problem of a config reported at once with its full key path."""

from __future__ import annotations

import collections
import dataclasses
import functools
import types
import typing
from typing import Any, Callable, Literal, Mapping, Optional, Sequence, Union, get_args, get_origin

from foundrymix.errors import ConfigError, Gather, check_keys, did_you_mean, foundry_advice, join
from foundrymix.config.loading import to_plain


_ABBREV = {'k': 10**3, 'm': 10**6, 'b': 10**9, 't': 10**12}


def number_abbrev_to_int(text: str) -> int:
    """``'2k'`` -> 2000 as streaming reads ``epoch_size`` (k, m, b, t), without importing it."""
    s = text.strip().lower()
    if s and s[-1] in _ABBREV:
        return int(float(s[:-1]) * _ABBREV[s[-1]])
    if s.isdigit():
        return int(s)
    raise ValueError(text)


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


@functools.lru_cache(maxsize=None)
def _kind(tp: Any) -> tuple[Any, tuple, Any, bool]:
    """``tp``'s (origin, args, own reader ``from_config``, is a dataclass), once per type:
    a many-stream YAML reads the same few types thousands of times."""
    return get_origin(tp), get_args(tp), getattr(tp, 'from_config', None), dataclasses.is_dataclass(tp)


def read_value(value: Any, tp: Any, where: str) -> Any:
    """``value`` read as type ``tp``; :class:`ConfigError` naming ``where`` when it is not one."""
    if tp is Any:
        return value
    origin, args, from_config, is_dataclass = _kind(tp)
    if origin in (Union, types.UnionType):
        return _read_union(value, args, where)
    if from_config is not None:  # a section with a reader of its own
        return from_config(value, where)
    if value is None:
        if is_dataclass:
            value = {}  # an empty YAML section (``dolly:``) is an empty mapping
        elif tp is not type(None):
            raise ConfigError(f'{where}: must not be null')
    if origin is Literal:
        if value not in args:
            advice = foundry_advice(f'{where}={value}') if isinstance(value, str) else None
            hint = (f'; {advice}' if advice else
                    did_you_mean(value, [a for a in args if isinstance(a, str)]) if isinstance(value, str) else '')
            raise ConfigError(f'{where}: {value!r} is not one of {", ".join(map(str, args))}{hint}')
        return value
    if is_dataclass:
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
        out, gather = {}, Gather()
        for k, v in value.items():
            with gather:
                if dataclasses.is_dataclass(val_tp):  # named sections: the key is their name
                    out[read_value(k, key_tp, where)] = read_dataclass(val_tp, v, join(where, str(k)), key=str(k))
                else:
                    out[read_value(k, key_tp, where)] = read_value(v, val_tp, join(where, str(k)))
        gather.raise_any()
        return out
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ConfigError(f'{where}: expected a list, got {value!r}')
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ConfigError(f'{where}: expected {len(args)} values, got {len(value)}')
        return tuple(read_value(v, a, f'{where}[{i}]') for i, (v, a) in enumerate(zip(value, args)))
    item_tp = args[0] if args else Any
    items, gather = [], Gather()
    for i, v in enumerate(value):
        with gather:
            items.append(read_value(v, item_tp, f'{where}[{i}]'))
    gather.raise_any()
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


def _read_number_or_text(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A reader of a float or a str: any number or text but a boolean (``yes`` is no float)."""
    def read(value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TypeError
        return convert(value)
    return read


_SCALARS = {bool: _read_bool, int: _read_int, float: _read_number_or_text(float), str: _read_number_or_text(str)}

#: field metadata: the field is filled from the mapping key the section sits under
FROM_KEY = {'from_key': True}
#: field metadata: the field is no key of the YAML; the dataclass derives it from its other fields
DERIVED = {'derived': True}


#: how :func:`read_dataclass` fills one field
_FieldPlan = collections.namedtuple('_FieldPlan', 'name tp from_key required')


@functools.lru_cache(maxsize=None)
def _dataclass_plan(cls: type) -> tuple[tuple[_FieldPlan, ...], tuple[str, ...], frozenset[str]]:
    """``cls``'s fields to read, its settable keys (list and set), once per class (a many-stream
    YAML reads one class thousands of times; ``get_type_hints`` re-evaluates every annotation)."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init and not f.metadata.get('derived')]
    plan = tuple(_FieldPlan(f.name, hints[f.name], bool(f.metadata.get('from_key')),
                            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in fields)
    settable = tuple(f.name for f in fields if not f.metadata.get('from_key'))
    return plan, settable, frozenset(settable)


def read_dataclass(cls: type, data: Any, where: str = '', key: Optional[str] = None) -> Any:
    """Build dataclass ``cls`` from a mapping, checking every key and value type; unknown keys,
    missing required ones and bad fields are reported at once, naming ``where``.
    A ``FROM_KEY`` field takes ``key`` (the section's mapping key, e.g. a stream's name). Optional
    hooks: ``cls.refuse_given(data, where)`` before reading, ``obj.check(where)`` after building."""
    data = to_plain(data, where)
    refuse = getattr(cls, 'refuse_given', None)
    if callable(refuse):
        refuse(data, where)
    plan, settable, settable_set = _dataclass_plan(cls)
    gather = Gather()  # every unknown key and every bad field, not just the first
    if not settable_set.issuperset(data):
        with gather:
            check_keys(data, list(settable), where)
    kwargs: dict[str, Any] = {}
    for f in plan:
        if f.from_key:
            kwargs[f.name] = key
        elif f.name in data:
            try:
                kwargs[f.name] = read_value(data[f.name], f.tp, join(where, f.name))
            except ConfigError as e:
                gather.add(e)
        elif f.required:
            gather.add(ConfigError(f'{where or "config"}: missing required key {f.name!r}',
                                   path=join(where, f.name)))
    gather.raise_any()  # checks across fields need every field read
    obj = cls(**kwargs)
    check = getattr(obj, 'check', None)
    if callable(check):
        check(where)
    return obj


@dataclasses.dataclass(frozen=True)
class TableEntry:
    """One part of a table section: its options' dataclass, what builds it from them, and the
    optional package it needs with the extra that installs it."""

    config: type
    factory: Optional[Callable[..., Any]] = None
    module: Optional[str] = None
    extra: Optional[str] = None


def read_table(cls: type, entries: Mapping[str, Any], value: Any, where: str,
               check: Optional[Callable[[str, str], None]] = None) -> Any:
    """``value`` as ``cls`` (a dict): a section of named parts (``callbacks``, ``loggers``, ...),
    each name's options read as ``entries[name].config``, then ``check(name, where)``; unknown
    names and bad options are refused all at once."""
    data, gather, out = to_plain(value, where), Gather(), cls()
    with gather:
        check_keys(data, list(entries), where)
    for name, options in data.items():
        if name in entries:
            with gather:
                out[name] = read_dataclass(entries[name].config, options, join(where, name))
                if check is not None:
                    check(name, join(where, name))
    gather.raise_any()
    return out

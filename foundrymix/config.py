"""The one config layer: YAML loading, a strict typed reader, and the one ``ConfigError``.

Why strict: a misspelt key (``repaet: 2``) silently dropped means a run trains on the
wrong mixture for days, and a value of the wrong type that slips through fails hours
later inside a library. So every config section of foundrymix is a dataclass, and
:func:`read_dataclass` turns a plain mapping into it, checking *every* annotation it
meets -- ``int``, ``float``, ``bool``, ``str``, ``Optional``/unions, ``Literal``
choices, ``list``, ``tuple``, ``dict`` and nested dataclasses -- from
``typing.get_type_hints`` (real types, not annotation text), and naming the full key
path (``train_loader.streams.arxiv.repeat``) in every error. It goes on past a bad key and
reports every problem of a config at once (:class:`ConfigErrors`, one line each), with the
nearest valid key or LLM-Foundry's rename (:data:`FOUNDRY_RENAMES`), each blamed on the
``key=value`` override that caused it, if one did (:func:`blame`).

omegaconf does what it is good at: YAML, ``${variables.x}`` interpolation and
``key=value`` overrides (:func:`load_yaml`). This module imports neither torch nor
composer, so reading a config (``foundrymix plan``) stays fast.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import inspect
import os
import re
import types
import typing
from typing import Any, Literal, Mapping, Optional, Sequence, Union, get_args, get_origin

from foundrymix.errors import FoundrymixError, MissingError, UserErrors


class ConfigError(FoundrymixError, ValueError):
    """A config cannot run; the message names the offending key path (and file).

    ``path``: the key path the error is about (default: the message's ``path:`` prefix),
    so an error can be blamed on the ``key=value`` override that set that key.
    """

    def __init__(self, message: str, path: Optional[str] = None) -> None:
        super().__init__(message)
        if path is None:
            m = _PATH_PREFIX.match(message)
            path = m.group(1) if m else None
        self.path = path


_PATH_PREFIX = re.compile(r'^([A-Za-z_][\w.\[\]-]*): ')


class ConfigErrors(UserErrors, ConfigError):
    """Every problem of a config found in one reading, one :class:`ConfigError` per line.

    Why: a config with 15 problems took 15 runs of ~25 s each to fix, one refusal per run
    (issue 21); the reader now goes on past a bad key and reports them all.
    """

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        self.errors = list(errors)
        UserErrors.__init__(self, [str(e) for e in self.errors])
        self.path = None


def errors_of(e: ConfigError) -> list[ConfigError]:
    """The single errors inside ``e`` (itself, unless it is a :class:`ConfigErrors`)."""
    return list(e.errors) if isinstance(e, ConfigErrors) else [e]


class Gather:
    """Collect :class:`ConfigError` s over several independent checks, then raise them all.

    ``with gather: ...`` records a ``ConfigError`` raised inside and goes on;
    :meth:`raise_any` raises the one error unchanged (its class kept: ``ModelConfigError``),
    or a :class:`ConfigErrors` of all of them.
    """

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []

    def __enter__(self) -> 'Gather':
        return self

    def __exit__(self, tp: Any, e: Any, tb: Any) -> bool:
        if isinstance(e, ConfigError):
            self.errors.extend(errors_of(e))
            return True
        return False

    def add(self, e: ConfigError) -> None:
        self.errors.extend(errors_of(e))

    def raise_any(self) -> None:
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise ConfigErrors(self.errors)


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


def _plain_yaml(path: str) -> Optional[dict[str, Any]]:
    """The YAML as omegaconf would return it, when omegaconf has nothing to do: a mapping
    with string keys of only strings without ``$`` (no interpolation, no escape), numbers,
    booleans, nulls, lists and mappings, and no node shared by aliases. Else ``None`` (then
    omegaconf reads it).

    Why: ``OmegaConf.create`` wraps every node of the document in its own node objects and
    ``to_container`` unwraps them again: 3.9 s of reading a 1,000-stream YAML, more than a
    raw ``StreamingDataset`` over the streams takes to start (issue 22). The YAML is read
    with omegaconf's own loader and node limit, so what it parses (and refuses) is the same.
    """
    import yaml
    from omegaconf.omegaconf import get_yaml_loader  # its own loader (2.3: _utils, 2.4: _yaml)

    kwargs: dict[str, Any] = {}
    if not ('OMEGACONF_MAX_YAML_EXPANDED_NODES' in os.environ or
            'max_yaml_expanded_nodes' not in inspect.signature(get_yaml_loader).parameters):
        kwargs['max_yaml_expanded_nodes'] = os.path.getsize(path) + ALIAS_NODE_ALLOWANCE
    with open(path, encoding='utf-8') as f:
        obj = yaml.load(f, Loader=get_yaml_loader(**kwargs))
    seen: set[int] = set()

    def plain(v: Any) -> bool:
        if isinstance(v, (dict, list)):
            if id(v) in seen:
                return False
            seen.add(id(v))
            if isinstance(v, dict):
                return all(type(k) is str and plain(x) for k, x in v.items())
            return all(plain(x) for x in v)
        if type(v) is str:
            return '$' not in v
        return v is None or type(v) in (bool, int, float)
    return obj if isinstance(obj, dict) and plain(obj) else None


@dataclasses.dataclass
class Override:
    """One ``key=value`` of the command line, as applied to the YAML."""

    text: str          # as typed
    key: str           # its key path (Hydra's ``+`` dropped)
    #: the first key of ``key``'s path the YAML did not have (the override created it), or None
    created: Optional[str] = None
    #: the YAML's keys beside ``created`` (to name the one the override probably meant)
    siblings: tuple[str, ...] = ()


def load_yaml(path: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Load ``path`` with omegaconf, apply ``key=value`` overrides, resolve interpolations."""
    return load_yaml_overrides(path, overrides)[0]


def load_yaml_overrides(path: str, overrides: Sequence[str] = ()) -> tuple[dict[str, Any], list[Override]]:
    """Load ``path`` with omegaconf, apply ``key=value`` overrides, resolve interpolations;
    also say what each override created (for :func:`blame`).

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
    applied: list[Override] = []
    pairs = []
    for item in overrides:
        if '=' not in item:
            raise ConfigError(f'override {item!r} is not key=value')
        key, value = item.split('=', 1)
        pairs.append((key[1:] if key.startswith('+') else key, value))
    try:
        if not pairs:
            plain = _plain_yaml(path)
            if plain is not None:
                return plain, applied
        cfg = _omegaconf_load(path)
        for (key, value), item in zip(pairs, overrides):
            applied.append(_created(cfg, Override(text=item, key=key)))
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
    return data, applied


def _created(cfg: Any, o: Override) -> Override:
    """``o`` with the first key of its path that ``cfg`` lacks (and that key's siblings)."""
    from omegaconf import OmegaConf
    node: Any = OmegaConf.to_container(cfg, resolve=False)
    parts = o.key.split('.')
    for i, part in enumerate(parts):
        if isinstance(node, dict):
            if part not in node:
                return dataclasses.replace(o, created='.'.join(parts[:i + 1]),
                                           siblings=tuple(str(k) for k in node))
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return o
    return o


def _normal_path(path: str) -> str:
    return re.sub(r'\[(\d+)\]', r'.\1', path)


def blame(error: ConfigError, path: str, overrides: Sequence[Override], data: Mapping[str, Any]) -> ConfigError:
    """``error`` (every line of it) prefixed with what caused it: the ``key=value`` override
    that set or created its key, else the YAML ``path``.

    Why: an override's typo was reported as the YAML's (``foo.yaml: train_loader: unknown key
    'strams'``), and a misspelt stream name in an override (``train_loader.streams.wbe.repeat=2``
    creates stream ``wbe``, with no location) said "needs local and/or remote" (issue 26).
    """
    lines: list[ConfigError] = []
    for e in errors_of(error):
        p = _normal_path(e.path) if e.path else None
        line = f'{path}: {e}'
        for o in reversed(overrides):  # the last override of a key wins, as applied
            created = o.created and p is not None and (p == o.created or p.startswith(o.created + '.'))
            if created and _is_new_stream(o, data):
                name = o.created.rsplit('.', 1)[1]
                names = list(o.siblings)
                if '.stages.' in o.created:  # a stage may also name any of its loader's streams
                    loader = data.get(o.created.split('.')[0])
                    top = loader.get('streams') if isinstance(loader, Mapping) else None
                    names += [str(n) for n in (top or {}) if str(n) not in names]
                line = (f'override {o.text!r}: no stream {name!r} in the YAML (streams: '
                        f'{", ".join(names) or "none"}){did_you_mean(name, names)}')
                break
            if created or (p is not None and (p == o.key or p.startswith(o.key + '.'))):
                line = f'override {o.text!r}: {e}'
                break
        if line not in [str(x) for x in lines]:
            lines.append(type(e)(line, path=e.path) if type(e).__init__ is ConfigError.__init__
                         else ConfigError(line, path=e.path))
    return lines[0] if len(lines) == 1 else ConfigErrors(lines)


def _is_new_stream(o: Override, data: Mapping[str, Any]) -> bool:
    """Did ``o`` create a stream (``...streams.NAME``) that has no location of its own?"""
    assert o.created is not None
    parent, _, name = o.created.rpartition('.')
    if not parent.endswith('streams'):
        return False
    node: Any = data
    for part in o.created.split('.'):
        if isinstance(node, Mapping):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    if not isinstance(node, Mapping) or node.get('local') or node.get('remote'):
        return False
    top = data.get(parent.split('.')[0])  # a stage's stream may take its location from the loader's
    top_streams = top.get('streams') if isinstance(top, Mapping) else None
    return '.stages.' not in o.created or not (isinstance(top_streams, Mapping) and name in top_streams)


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


#: LLM-Foundry keys (key path; ``*`` matches one name) and what a foundrymix YAML says
#: instead, or why there is nothing to say. An unknown key found here gets this advice
#: instead of the nearest allowed key (``fsdp_config`` is not a typo of anything).
FOUNDRY_RENAMES: dict[str, str] = {
    'fsdp_config': "LLM-Foundry's fsdp_config is 'fsdp' here (same keys)",
    'console_log_interval': "LLM-Foundry's console_log_interval is 'log_interval' here",
    'global_seed': "LLM-Foundry's global_seed is 'seed' here",
    'log_to_console': "LLM-Foundry's log_to_console: the console logger is on unless loggers leaves "
                      "it out (loggers: {console: {}}); delete the key",
    'python_log_level': "LLM-Foundry's python_log_level has no equivalent; delete it",
    'dist_timeout': "LLM-Foundry's dist_timeout has no equivalent; delete it",
    'icl_tasks': "LLM-Foundry's in-context-learning evaluation (icl_tasks) is not supported; "
                 "delete it (see docs/train.md)",
    'icl_subset_num_batches': "LLM-Foundry's in-context-learning evaluation is not supported; delete it",
    'icl_seq_len': "LLM-Foundry's in-context-learning evaluation is not supported; delete it",
    'eval_gauntlet': "LLM-Foundry's eval gauntlet is not supported; delete it (see docs/train.md)",
    'save_weights_only': "LLM-Foundry's save_weights_only has no equivalent (checkpoints hold the "
                         "optimizer and loader state, for resuming); delete it",
    '*_loader.name': "LLM-Foundry's loader name (text, finetuning) has no equivalent: each stream's "
                     "converted format decides; delete it",
    '*_loader.dataset': "LLM-Foundry's {loader}.dataset: its keys go directly under {loader} "
                        "(dataset.streams -> {loader}.streams; dataset.local/remote/split -> "
                        "{loader}.streams.NAME.local/remote/split; dataset.shuffle, shuffle_seed, ... -> "
                        "{loader}.shuffle, ...; dataset.max_seq_len -> the top-level max_seq_len)",
    '*_loader.streams.*.weight': "LLM-Foundry has no stream 'weight'; give repeat, proportion or choose",
    'model.name': "LLM-Foundry's model.name (hf_causal_lm, mpt_causal_lm) is model.type here: a "
                  "transformers model_type (llama, gpt2, mpt, ...)",
    'model.init_device': "LLM-Foundry's model.init_device has no equivalent (fsdp builds the model); "
                         "delete it",
    'model.loss_fn': "LLM-Foundry's model.loss_fn has no equivalent (the loss is transformers' "
                     "cross-entropy on the labels); delete it",
}


def foundry_advice(path: str) -> Optional[str]:
    """The :data:`FOUNDRY_RENAMES` advice for key path ``path``, or None."""
    for pattern, advice in FOUNDRY_RENAMES.items():
        if fnmatch.fnmatchcase(path, pattern) and path.count('.') == pattern.count('.'):
            return advice.replace('{loader}', path.split('.')[0])
    return None


def did_you_mean(key: str, allowed: Sequence[str]) -> str:
    """``"; did you mean 'x'?"`` for the allowed key nearest to ``key``, or ``''``."""
    near = difflib.get_close_matches(key, list(allowed), n=1)
    return f'; did you mean {near[0]!r}?' if near else ''


def check_keys(d: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    """Refuse keys not in ``allowed`` (every one of them, one error each), naming the key, every
    allowed one and the nearest (or LLM-Foundry's spelling's equivalent)."""
    gather = Gather()
    for key in d:
        if key not in allowed:
            path = join(where, str(key))
            advice = foundry_advice(path)
            hint = f'; {advice}' if advice else did_you_mean(str(key), allowed)
            gather.add(ConfigError(f'{where or "config"}: unknown key {key!r}; allowed: '
                                   f'{", ".join(allowed)}{hint}', path=path))
    gather.raise_any()


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


_INTERVAL = re.compile(r'\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*(ep|ba|sp|tok|dur|iter)\s*', re.IGNORECASE)


def check_interval(text: str, where: str) -> None:
    """A Composer time string with its unit (``500ba``, ``1ep``, ``0.05dur``), checked up front.

    Why: Composer reads a bare ``eval_interval: 1`` (the string ``'1'`` here) as a time delta,
    not one epoch or batch; a unit-less interval is refused as ``max_duration`` is.
    """
    m = _INTERVAL.fullmatch(text)
    if re.fullmatch(r'\s*\d+(\.\d*)?\s*', text):
        raise ConfigError(f'{where}: {text!r} has no unit; write it as a Composer time string '
                          f'(e.g. {text.strip()}ba or {text.strip()}ep)')
    if not m:
        raise ConfigError(f'{where}: {text!r} is not a Composer time string (a number and ep, ba, '
                          f'sp, tok, iter or dur, e.g. 500ba, 1ep, 0.05dur)')
    if m.group(2).lower() != 'dur' and not float(m.group(1)).is_integer():
        raise ConfigError(f'{where}: {text!r}: {m.group(2)} needs a whole number')


class Duration(str):
    """A run length (``max_duration``, a stage's ``duration``): a whole number of ep, ba, sp or
    tok, unit required (:func:`check_duration`)."""

    @classmethod
    def from_config(cls, value: Any, where: str) -> 'Duration':
        text = read_value(value, str, where)
        check_duration(text, where)
        return cls(text)


class Interval(str):
    """How often something happens (``eval_interval``, ``save_interval``, ``log_interval``,
    ``t_warmup``, ...): a Composer time string with its unit (:func:`check_interval`)."""

    @classmethod
    def from_config(cls, value: Any, where: str) -> 'Interval':
        text = read_value(value, str, where)
        check_interval(text, where)
        return cls(text)


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
    """``tp``'s (origin, args, own reader ``from_config``, is a dataclass), once per type: a
    1,000-stream YAML reads ~4,000 values, and working these out each time was half of the
    typed read (issue 22)."""
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
#: field metadata: the field is no key of the YAML; the dataclass derives it from its other fields
DERIVED = {'derived': True}


@dataclasses.dataclass(frozen=True)
class _FieldPlan:
    """How :func:`read_dataclass` fills one field."""

    name: str
    tp: Any
    from_key: bool
    required: bool


@functools.lru_cache(maxsize=None)
def _dataclass_plan(cls: type) -> tuple[tuple[_FieldPlan, ...], tuple[str, ...], frozenset[str]]:
    """``cls``'s fields to read, its settable keys (list and set), once per class.

    ``typing.get_type_hints`` re-evaluates every annotation on each call (1.5 ms per stream
    section: 1.5 s of reading a 1,000-stream YAML), and ``dataclasses.fields`` plus the
    metadata lookups were another third of the typed read (issue 22)."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init and not f.metadata.get('derived')]
    plan = tuple(_FieldPlan(f.name, hints[f.name], bool(f.metadata.get('from_key')),
                            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in fields)
    settable = tuple(f.name for f in fields if not f.metadata.get('from_key'))
    return plan, settable, frozenset(settable)


def read_dataclass(cls: type, data: Any, where: str = '', key: Optional[str] = None,
                   allow_extra: Sequence[str] = ()) -> Any:
    """Build dataclass ``cls`` from a mapping, checking every key and every value's type.

    Unknown keys (except ``allow_extra``) and missing required fields are errors naming
    ``where``; every one of them, and every bad field, is reported at once
    (:class:`ConfigErrors`). A field with ``metadata=FROM_KEY`` takes ``key`` (the mapping key of the
    section, e.g. a stream's name) instead of a value from ``data``. After building,
    ``cls.check(self, where)`` runs if defined: checks that need several fields; before
    anything is read, ``cls.refuse_given(data, where)`` if defined: keys refused as given.
    """
    data = to_plain(data, where)
    refuse = getattr(cls, 'refuse_given', None)
    if callable(refuse):
        refuse(data, where)
    plan, settable, settable_set = _dataclass_plan(cls)
    gather = Gather()  # every unknown key and every bad field, not just the first
    if not settable_set.issuperset(data):
        with gather:
            check_keys(data, list(settable) + [k for k in allow_extra if k not in settable_set], where)
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


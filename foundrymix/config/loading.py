"""YAML loading: omegaconf for YAML, ``${variables.x}`` and ``key=value`` overrides (each error
blamed on the override that caused it, if one did), without omegaconf's node limit on plain YAML."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
from typing import Any, Mapping, Optional, Sequence

from foundrymix.errors import ConfigError, ConfigErrors, MissingError, did_you_mean, errors_of


#: ``--help`` of the ``key=value`` arguments of ``train`` and ``plan`` (see :func:`load_yaml`)
OVERRIDES_HELP = ('key=value overrides of the YAML (omegaconf dotlist, e.g. train_loader.shuffle_seed=3); '
                  'a mapping or list value ({...}, [...]) replaces the YAML\'s value at that key, '
                  'it is not merged into it')


#: what omegaconf 2.4 lets YAML aliases add beyond what a file spells out (its own default)
ALIAS_NODE_ALLOWANCE = 10_000


def _node_limit(load: Any, path: str) -> dict[str, int]:
    """``max_yaml_expanded_nodes`` for omegaconf's ``load`` of ``path``: the file's size plus
    :data:`ALIAS_NODE_ALLOWANCE` (a plain mix of thousands of streams has more than 10,000 nodes):
    what the file spells out is never refused, aliases may still add 10,000 nodes, and omegaconf's
    ratio guard against alias bombs stays on. None where ``load`` has no such limit (omegaconf < 2.4)
    or ``OMEGACONF_MAX_YAML_EXPANDED_NODES`` is set (then omegaconf's own setting holds)."""
    if ('max_yaml_expanded_nodes' not in inspect.signature(load).parameters
            or 'OMEGACONF_MAX_YAML_EXPANDED_NODES' in os.environ):
        return {}
    return {'max_yaml_expanded_nodes': os.path.getsize(path) + ALIAS_NODE_ALLOWANCE}


def _plain_yaml(path: str) -> Optional[dict[str, Any]]:
    """The YAML as omegaconf would return it when omegaconf has nothing to do (string keys; strings
    without ``$``, numbers, booleans, nulls, lists, mappings; no node shared by aliases), else None.
    Skips wrapping every node in omegaconf objects, the bulk of reading a many-stream YAML; read
    with omegaconf's own loader and node limit, so it parses (and refuses) the same."""
    import yaml
    from omegaconf.omegaconf import get_yaml_loader  # its own loader (2.3: _utils, 2.4: _yaml)

    with open(path, encoding='utf-8') as f:
        obj = yaml.load(f, Loader=get_yaml_loader(**_node_limit(get_yaml_loader, path)))
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


def load_yaml(path: str, overrides: Sequence[str] = (), resolve: bool = True) -> dict[str, Any]:
    """Load ``path`` with omegaconf, apply ``key=value`` overrides, resolve interpolations (unless
    ``resolve`` is False: ``${...}`` kept as written)."""
    return load_yaml_overrides(path, overrides, resolve)[0]


def load_yaml_overrides(path: str, overrides: Sequence[str] = (),
                        resolve: bool = True) -> tuple[dict[str, Any], list[Override]]:
    """:func:`load_yaml`, and what each override created (for :func:`blame`).

    A mapping or list value (``train_loader.streams={a: {local: /d}}``) *replaces* the YAML's
    value: merging would keep every stream the YAML had besides, silently. Hydra's ``+key=value``
    is the plain ``key=value``: the typed reader decides whether the key exists.
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
        cfg = OmegaConf.load(path, **_node_limit(OmegaConf.load, path))
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
        data = OmegaConf.to_container(cfg, resolve=resolve)
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


def blame(error: ConfigError, path: str, overrides: Sequence[Override], data: Mapping[str, Any]) -> ConfigError:
    """``error`` (every line) prefixed with its cause: the ``key=value`` override that set or created
    its key, else the YAML ``path``; an override that creates a stream without a location
    (``streams.wbe.repeat=2``) is named a misspelt stream, with the streams the YAML has."""
    lines: list[ConfigError] = []
    for e in errors_of(error):
        p = re.sub(r'\[(\d+)\]', r'.\1', e.path) if e.path else None  # a[0].b as overrides name it: a.0.b
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

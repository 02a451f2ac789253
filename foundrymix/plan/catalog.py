"""The catalog: each stream's location and small metadata (manifest, index), read once per run;
a remote's fetched afresh on every start (:func:`sync_remote`), so a re-uploaded dataset is never
read through stale cached shards. Streams that cannot share a batch or are not whole are refused
before any row is read (:meth:`Catalog.validate`)."""

from __future__ import annotations

import contextlib
import filecmp
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

from foundrymix.config import ConfigError
from foundrymix.plan.config import LoaderConfig, StreamSpec, cache_base
from foundrymix.plan.exact import resolve_groups
from foundrymix.format.advice import adopt_advice, is_foundry_tokens, splits_advice
from foundrymix.format.schema import MANIFEST_NAME, SCHEMA_VERSION, Manifest, TokenizerInfo
from foundrymix.format.shards import (INDEX_NAME, check_shard_files, hashes_dropped_problem, index_files,
                                      read_index, row_count_problem, shard_files_error, shard_raw_bytes,
                                      stored_name, validate_hash_problem)
from foundrymix.format.foundry_tokens import in_place_manifest
from foundrymix.s3.remote import RemoteError, download, local_denied
from foundrymix.tokenizer import describe_tokenizer

logger = logging.getLogger(__name__)


def _read_index(path: str, where: str) -> dict[str, Any]:
    try:
        return read_index(path)
    except ValueError as e:
        raise ConfigError(f'{where}: {e}') from e


def _file(location: str, basename: str) -> str:
    """``basename`` inside a local directory or under a remote prefix, for messages."""
    return f'{location.rstrip("/")}/{basename}' if '://' in location else os.path.join(location, basename)


@dataclass(frozen=True)
class StreamInfo:
    """What the catalog knows of one stream, from its manifest and index only."""

    name: str
    spec: StreamSpec
    local: str                  # streaming's ``local`` (without split)
    directory: str              # local directory of index.json and manifest (with split)
    remote_dir: Optional[str]   # remote directory of the same (with split), if remote
    manifest: Manifest
    index: dict[str, Any]       # index.json as read
    where: str                  # config key path, for messages

    @property
    def shard_rows(self) -> list[int]:
        """Rows per shard, from ``index.json``."""
        return [int(shard['samples']) for shard in self.index['shards']]

    @property
    def rows(self) -> int:
        return sum(self.shard_rows)


class Catalog:
    """The streams of one loader config: metadata fetched and read once, then validated."""

    def __init__(self, config: LoaderConfig, where: str = 'train_loader',
                 shared: Optional[dict[Any, StreamInfo]] = None) -> None:
        self.config = config
        self.where = where
        self._infos: dict[str, StreamInfo] = {}
        #: metadata read by the run's other catalogs (its stages), keyed by location: read once
        self._shared: dict[Any, StreamInfo] = shared if shared is not None else {}
        self._synced: set[str] = set()
        self._validated = False
        self._resolved: Optional[list[StreamInfo]] = None

    @property
    def names(self) -> list[str]:
        return list(self.config.streams)

    def _where(self, name: str) -> str:
        return f'{self.where}.streams.{name}'

    # ------------------------------------------------------------ metadata
    def fetch(self, name: str, basename: str) -> str:
        """Local path of a stream's small metadata file; a remote's manifest and index are
        fetched afresh first, once per catalog."""
        if self.config.stream_remote_dir(name) is not None and name not in self._synced:
            sync_remote(self.config, name, self._where(name))
            self._synced.add(name)
        return os.path.join(self.config.stream_dir(name), basename)

    def info(self, name: str) -> StreamInfo:
        """Manifest and index of stream ``name`` (fetched if remote-only), read once."""
        if name not in self._infos:
            key = (self.config.stream_dir(name), self.config.stream_remote_dir(name))
            known = self._shared.get(key)
            if known is None:
                known = self._shared[key] = self._read(name)
            else:  # the same files under this catalog's name, weights and key path
                known = self._stream_info(name, known.manifest, known.index, known.directory)
            self._infos[name] = known
        return self._infos[name]

    def _read(self, name: str) -> StreamInfo:
        where = self._where(name)
        path, index_path = self.fetch(name, MANIFEST_NAME), self.fetch(name, INDEX_NAME)
        if not os.path.isfile(path):
            if os.path.isfile(index_path):
                index = _read_index(index_path, where)
                if is_foundry_tokens(index):
                    return self._foundry_tokens(name, index, os.path.dirname(index_path))
                raise ConfigError(f'{where}: no foundrymix manifest {path}; '
                                  f'{adopt_advice(self.config.stream_dir(name))}')
            directory = self.config.stream_dir(name)
            splits = splits_advice(directory) if '://' not in directory else None
            raise ConfigError(f'{where}: no foundrymix manifest {path} ' + (f'({splits})' if splits else (
                f'(is {directory!r} a directory made by `foundrymix convert`?)')))
        try:
            manifest = Manifest.read(os.path.dirname(path))
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f'{where}: {e}') from e
        if self.config.streams[name].tokenizer:
            raise ConfigError(f'{where}.tokenizer: only for LLM-Foundry token shards read in place; this '
                              f'stream records the tokenizer it was converted with ({manifest.tokenizer.name}): '
                              f'leave tokenizer out', path=f'{where}.tokenizer')
        if not os.path.isfile(index_path):
            raise ConfigError(f'{where}: manifest but no {INDEX_NAME} in '
                              f'{os.path.dirname(index_path)} (an incomplete conversion?)')
        return self._stream_info(name, manifest, _read_index(index_path, where), os.path.dirname(index_path))

    def _stream_info(self, name: str, manifest: Manifest, index: dict[str, Any], directory: str) -> StreamInfo:
        return StreamInfo(name=name, spec=self.config.streams[name], local=self.config.stream_local(name),
                          directory=directory, remote_dir=self.config.stream_remote_dir(name),
                          manifest=manifest, index=index, where=self._where(name))

    def _foundry_tokens(self, name: str, index: dict[str, Any], directory: str) -> StreamInfo:
        """LLM-Foundry token shards used in place: a manifest made in memory from ``index.json``,
        shard 0 (its row length and document rule) and the stream's ``tokenizer``."""
        where, spec = self._where(name), self.config.streams[name]
        name_or_dir = spec.tokenizer or self.config.tokenizer
        if not name_or_dir:
            raise ConfigError(f"{where}: LLM-Foundry token shards (one tokens column, no foundrymix.json): "
                              f"to use them in place give the tokenizer they were made with, "
                              f"{where}.tokenizer: NAME_OR_DIR or a top-level tokenizer: (or make a dataset "
                              f"of them: `foundrymix adopt {self.config.stream_dir(name)} --tokenizer NAME_OR_DIR "
                              f"--out DIR`)", path=f'{where}.tokenizer')
        memo = os.path.join(cache_base(self.config.cache_root), 'tokenizers')
        tokenizer = describe_tokenizer(name_or_dir, memo)
        first = index['shards'][0]
        data = shard_raw_bytes(first, self._shard_bytes(name, stored_name(first)))
        try:
            manifest = in_place_manifest(index, data, tokenizer, where)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return self._stream_info(name, manifest, index, directory)

    def _shard_bytes(self, name: str, basename: str) -> bytes:
        """A shard file's bytes: the local copy, else fetched from the remote into a file of
        this process that is removed after reading (the loader's cache accounts for its own)."""
        path = os.path.join(self.config.stream_dir(name), basename)
        remote_dir = self.config.stream_remote_dir(name)
        if remote_dir is None or os.path.isfile(path):
            with open(path, 'rb') as f:
                return f.read()
        part = f'{path}.part-{os.getpid()}'
        try:
            download(f'{remote_dir.rstrip("/")}/{basename}', part, self.config.download_timeout)
            with open(part, 'rb') as f:
                return f.read()
        except RemoteError as e:
            raise ConfigError(f'{self._where(name)}: cannot read {e}') from e
        finally:
            if os.path.exists(part):
                os.remove(part)

    def infos(self) -> list[StreamInfo]:
        """Every stream's info, in config order, validated, each with its own weight (groups
        resolved once here, so the plan, the fingerprint and the loader see the same)."""
        self.validate()
        if self._resolved is None:
            self._resolved = resolve_groups(self.config, [self.info(n) for n in self.names],
                                            self.where)
        return list(self._resolved)

    @property
    def manifests(self) -> dict[str, Manifest]:
        return {n: self.info(n).manifest for n in self.names}

    # ------------------------------------------------------------ validation
    def validate(self) -> None:
        """Refuse streams that cannot share a batch or are not whole, before any row is read."""
        if self._validated:
            return
        self._check_distinct_dirs()
        infos = [self.info(n) for n in self.names]
        for info in infos:
            self._check_stream(info)
        self._check_agree(infos)
        self._validated = True

    def _check_distinct_dirs(self) -> None:
        seen: dict[str, str] = {}
        for name in self.names:
            d = os.path.normpath(self.config.stream_dir(name))
            if d in seen:
                raise ConfigError(
                    f'{self.where}.streams: {seen[d]} and {name} use the same directory {d}; '
                    f'streaming needs a distinct local directory per stream (to use one dataset '
                    f'twice, give one stream a single repeat/proportion, or copy/symlink the dir)')
            seen[d] = name

    def _check_stream(self, info: StreamInfo) -> None:
        m, where = info.manifest, info.where
        if m.schema_version != SCHEMA_VERSION:
            raise ConfigError(
                f'{where}: manifest schema version {m.schema_version}, this foundrymix reads '
                f'version {SCHEMA_VERSION}; re-run `foundrymix convert`')
        if m.kind not in ('pretrain', 'finetune'):
            raise ConfigError(f'{where}: unknown manifest kind {m.kind!r}')
        if m.counts.rows <= 0:
            raise ConfigError(f'{where}: stream has no rows')
        location = info.remote_dir or info.directory
        problem = row_count_problem(_file(location, INDEX_NAME), _file(location, MANIFEST_NAME),
                                    info.rows, m.counts.rows, location)
        if problem:
            raise ConfigError(f'{where}: {problem} (`foundrymix verify {location}` shows which '
                              f'shards are there)')
        # a remote stream's cached shards are checked when first opened (foundrymix.loader.storage)
        problems = [] if info.remote_dir is not None else check_shard_files(info.directory, info.index)
        if problems:
            raise shard_files_error(info.name, info.directory, problems)
        problem = hashes_dropped_problem(info.index, m.options.get('hashes') or (),
                                         _file(location, INDEX_NAME), _file(location, MANIFEST_NAME))
        if problem and info.remote_dir is None and self.config.hash_local_shards:
            raise ConfigError(f'{where}: {problem}. Re-run `foundrymix convert` into {location} with '
                              f'--overwrite (or restore its {INDEX_NAME}), or set '
                              f'{self.where}.hash_local_shards: false to train it unchecked')
        problem = validate_hash_problem(info.name, info.index, self.config.validate_hash)
        if problem:
            raise ConfigError(f'{self.where}.validate_hash: {problem}')

    def _check_agree(self, infos: list[StreamInfo]) -> None:
        """Streams share a batch only with one ``max_seq_len``, one tokenizer and one pad id. A
        tokenizer is what it is (its fingerprint), not how its path was spelled at conversion."""
        def tokenizer(m: Manifest) -> str:
            return f'{m.tokenizer.name} (fingerprint {m.tokenizer.fingerprint[:12]}, vocab {m.tokenizer.vocab_size})'
        checks = (  # (what, the value that must agree, how it is shown)
            ('max_seq_len', lambda m: m.max_seq_len, lambda m: m.max_seq_len),
            ('tokenizer', lambda m: m.tokenizer.fingerprint, tokenizer),
            ('pad id', lambda m: m.tokenizer.pad_id, lambda m: m.tokenizer.pad_id),
        )
        for what, key, show in checks:
            if len({key(i.manifest) for i in infos}) > 1:
                listing = ', '.join(f'{i.name}: {show(i.manifest)}' for i in infos)
                raise ConfigError(f'{self.where}.streams: streams disagree on {what} ({listing}); every '
                                  f'stream of one loader must be converted with the same {what}')

    @property
    def max_seq_len(self) -> int:
        self.validate()
        return self.info(self.names[0]).manifest.max_seq_len

    @property
    def tokenizer(self) -> TokenizerInfo:
        self.validate()
        return self.info(self.names[0]).manifest.tokenizer


# ------------------------------------------------------------ remote metadata
def sync_remote(config: LoaderConfig, name: str, where: str) -> None:
    """Fetch a remote stream's manifest and index afresh: if they changed, foundrymix's own cache
    drops the old index's shards (warning), a ``local:`` the user named is refused. An unreachable
    remote raises even with a cached copy, which might be stale."""
    remote_dir = config.stream_remote_dir(name)
    assert remote_dir is not None
    directory = config.stream_dir(name)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise local_denied(e, os.path.join(directory, INDEX_NAME)) or e from None
    # a stream given a tokenizer is LLM-Foundry token shards: no manifest to fetch
    wanted = (INDEX_NAME,) if config.streams[name].tokenizer else (MANIFEST_NAME, INDEX_NAME)
    fresh = {b: os.path.join(directory, f'{b}.part-{os.getpid()}') for b in wanted}
    try:
        for basename, part in list(fresh.items()):
            url = f'{remote_dir.rstrip("/")}/{basename}'
            try:
                download(url, part, config.download_timeout)
            except RemoteError as e:
                if e.kind == 'not_found' and basename == MANIFEST_NAME and config.tokenizer:
                    del fresh[basename]  # perhaps LLM-Foundry token shards: the index says
                    continue
                raise _remote_error(config, name, where, basename, e) from e
        cached = [b for b in fresh if os.path.isfile(os.path.join(directory, b))]
        filecmp.clear_cache()  # its memo keys on (size, mtime): never trusted for a safety check
        changed = [b for b, part in fresh.items()
                   if b not in cached or not filecmp.cmp(part, os.path.join(directory, b), shallow=False)]
        if cached and changed:
            _remote_changed(config, name, where, directory, remote_dir, changed)
        for basename, part in fresh.items():  # the index last: it names the shards
            os.replace(part, os.path.join(directory, basename))
    finally:
        for part in fresh.values():
            if os.path.exists(part):
                os.remove(part)


def _remote_error(config: LoaderConfig, name: str, where: str, basename: str, e: Any) -> ConfigError:
    remote_dir, directory = config.stream_remote_dir(name), config.stream_dir(name)
    if e.kind == 'not_found' and basename == MANIFEST_NAME:
        return ConfigError(
            f'{where}: no foundrymix manifest at {e.url} ({e.code}: no such object). Check '
            f'that remote {remote_dir!r} (bucket and path) is right and holds a whole '
            f'directory made by `foundrymix convert` ({MANIFEST_NAME}, {INDEX_NAME} and shards)')
    if e.kind == 'not_found':
        return ConfigError(
            f'{where}: no {INDEX_NAME} at {e.url} ({e.code}: no such object), though '
            f'{MANIFEST_NAME} is there: an incomplete conversion or upload? Re-run '
            f'`foundrymix convert` into {remote_dir!r} (it uploads {INDEX_NAME} last)')
    cached = os.path.isfile(os.path.join(directory, INDEX_NAME))
    note = (f' (a copy is cached in {directory}, but without the remote nothing tells '
            f'whether it is current, so it is not used)' if cached else '')
    return ConfigError(f'{where}: cannot read {e}{note}')


def _remote_changed(config: LoaderConfig, name: str, where: str, directory: str, remote_dir: str,
                    changed: list[str]) -> None:
    """The remote's metadata differs from the local copy: refresh our cache, or refuse."""
    spec = config.streams[name]
    what = ' and '.join(changed)
    if spec.local:
        raise ConfigError(
            f'{where}: remote {remote_dir} changed since local {directory} was filled ({what} '
            f'differ): its shard files are stale, and streaming would read them as the new '
            f"dataset's. foundrymix never deletes files in a directory you named in local:; "
            f'delete {directory} (to download the new dataset there), point local: at an '
            f"empty directory, or leave local: out to use foundrymix's cache (refreshed "
            f'when its remote changes)')
    removed = 0
    try:
        old = read_index(os.path.join(directory, INDEX_NAME))
    except ValueError:
        old = {}  # no readable old index: nothing it named can be trusted
    for base in sorted(index_files(old)):
        for path in (os.path.join(directory, base), os.path.join(directory, base + '.tmp')):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
                removed += 1
    logger.warning('%s: remote %s changed since the cache %s was filled (%s differ): '
                   'fetched the new metadata and removed %d stale cached shard file(s)',
                   where, remote_dir, directory, what, removed)

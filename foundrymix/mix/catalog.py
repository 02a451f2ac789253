"""The catalog: where each stream's files are, its small metadata, and its ``streaming.Stream``.

Why one module: the mixer, the plan and every CLI need the same facts about a stream --
its manifest (``foundrymix.json``), rows per shard (``index.json``), whether its shards
are whole -- and remote streams need them fetched first. Only this module knows how:
local paths, streaming's own downloader for remotes (every backend streaming supports),
and one place that tells "not found" from "cannot reach". Nothing here reads a shard.

:meth:`Catalog.validate` refuses streams that cannot share a batch (``max_seq_len``,
tokenizer, schema) before a single row is read: streaming only notices when it reads a
row, or never, if the columns happen to decode.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from foundrymix.config import ConfigError
from foundrymix.mix.config import LoaderConfig, StreamSpec
from foundrymix.schema import MANIFEST_NAME, SCHEMA_VERSION, Manifest, TokenizerInfo
from foundrymix.shards import is_not_found

INDEX_NAME = 'index.json'


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
        """Rows per shard, from ``index.json`` (what streaming reads)."""
        return [int(shard['samples']) for shard in self.index['shards']]

    @property
    def rows(self) -> int:
        return sum(self.shard_rows)

    @property
    def hashes(self) -> set[str]:
        """Hash algorithms recorded for every shard of this stream (empty if none)."""
        from foundrymix.shards import hashes_in_index
        return hashes_in_index(self.index)


class Catalog:
    """The streams of one loader config: metadata fetched and read once, then validated."""

    def __init__(self, config: LoaderConfig, where: str = 'train_loader') -> None:
        self.config = config
        self.where = where
        self._infos: dict[str, StreamInfo] = {}
        self._validated = False

    @property
    def names(self) -> list[str]:
        return list(self.config.streams)

    def _where(self, name: str) -> str:
        return f'{self.where}.streams.{name}'

    # ------------------------------------------------------------ metadata
    def fetch(self, name: str, basename: str) -> str:
        """Local path of a stream's small metadata file, downloading it if remote-only.

        Uses streaming's own downloader, so every remote streaming supports works and the
        file lands where ``Stream`` expects its index (``local/split``).
        """
        local_path = os.path.join(self.config.stream_dir(name), basename)
        if os.path.isfile(local_path):
            return local_path
        remote_dir = self.config.stream_remote_dir(name)
        if remote_dir is None:
            return local_path  # the caller reports it missing
        from streaming.base.storage import CloudDownloader
        remote_path = os.path.join(remote_dir, basename)
        # Into a file of this process's own, then renamed: the ranks of a node fetch the same
        # file into the same cache at once, and must never see each other's half-copies.
        part = f'{local_path}.part-{os.getpid()}'
        try:
            os.makedirs(os.path.dirname(local_path), exist_ok=True)
            CloudDownloader.direct_download(remote_path, part, self.config.download_timeout)
            os.replace(part, local_path)
        except Exception as e:  # downloader errors vary by backend
            if os.path.exists(part):
                os.remove(part)
            if is_not_found(e):
                what = 'foundrymix manifest' if basename == MANIFEST_NAME else basename
                raise ConfigError(
                    f'{self._where(name)}: no {what} at {remote_path} (not found or access '
                    f'denied). Check that remote {remote_dir!r} (bucket and path) is right and '
                    f'holds a whole directory made by `foundrymix convert` ({MANIFEST_NAME}, '
                    f'{INDEX_NAME} and shards)') from e
            raise ConfigError(f'{self._where(name)}: cannot download {remote_path}: '
                              f'{type(e).__name__}: {e}') from e
        return local_path

    def info(self, name: str) -> StreamInfo:
        """Manifest and index of stream ``name`` (fetched if remote-only), read once."""
        if name not in self._infos:
            self._infos[name] = self._read(name)
        return self._infos[name]

    def _read(self, name: str) -> StreamInfo:
        where = self._where(name)
        path = self.fetch(name, MANIFEST_NAME)
        if not os.path.isfile(path):
            raise ConfigError(
                f'{where}: no foundrymix manifest {path} (is {self.config.stream_dir(name)!r} a '
                f'directory made by `foundrymix convert`?)')
        try:
            manifest = Manifest.read(os.path.dirname(path))
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f'{where}: {e}') from e
        index_path = self.fetch(name, INDEX_NAME)
        if not os.path.isfile(index_path):
            raise ConfigError(f'{where}: manifest but no {INDEX_NAME} in '
                              f'{os.path.dirname(index_path)} (an incomplete conversion?)')
        from foundrymix.shards import read_index
        try:
            index = read_index(index_path)
        except ValueError as e:
            raise ConfigError(f'{where}: {e}') from e
        return StreamInfo(name=name, spec=self.config.streams[name],
                          local=self.config.stream_local(name),
                          directory=os.path.dirname(index_path),
                          remote_dir=self.config.stream_remote_dir(name), manifest=manifest,
                          index=index, where=where)

    def infos(self) -> list[StreamInfo]:
        """Every stream's info, in config order, validated (see :meth:`validate`)."""
        self.validate()
        return [self.info(n) for n in self.names]

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
        from foundrymix.shards import check_shard_files, shard_files_error, validate_hash_problem
        problems = check_shard_files(info.directory, info.index,
                                     allow_missing=info.remote_dir is not None)
        if problems:
            raise shard_files_error(info.name, info.directory, problems)
        problem = validate_hash_problem(info.name, info.index, self.config.validate_hash)
        if problem:
            raise ConfigError(f'{self.where}.validate_hash: {problem}')

    def _check_agree(self, infos: list[StreamInfo]) -> None:
        checks = (
            ('max_seq_len', lambda m: m.max_seq_len),
            ('tokenizer', lambda m: f'{m.tokenizer.name} (fingerprint '
                                    f'{m.tokenizer.fingerprint[:12]}, vocab {m.tokenizer.vocab_size})'),
            ('pad id', lambda m: m.tokenizer.pad_id),
            # The short tokenizer description above could collide; the fingerprint decides.
            ('tokenizer fingerprint', lambda m: m.tokenizer.fingerprint),
        )
        for what, get in checks:
            values = {i.name: get(i.manifest) for i in infos}
            if len(set(values.values())) > 1:
                listing = ', '.join(f'{n}: {v}' for n, v in values.items())
                tail = ('' if what == 'tokenizer fingerprint' else
                        f'; every stream of one loader must be converted with the same {what}')
                raise ConfigError(f'{self.where}.streams: streams disagree on {what} '
                                  f'({listing}){tail}')

    @property
    def max_seq_len(self) -> int:
        self.validate()
        return self.info(self.names[0]).manifest.max_seq_len

    @property
    def tokenizer(self) -> TokenizerInfo:
        self.validate()
        return self.info(self.names[0]).manifest.tokenizer


def units_per_row(info: StreamInfo, weights_in: str) -> float:
    """Rows, real tokens or loss tokens per row of a stream, on average (from its manifest)."""
    c = info.manifest.counts
    if weights_in == 'rows':
        return 1.0
    total = c.tokens if weights_in == 'tokens' else c.loss_tokens
    if total <= 0:
        raise ConfigError(f'{info.where}: weights_in {weights_in}: the stream has no '
                          f'{weights_in.replace("_", " ")}, so no share of them can be drawn from it')
    return total / c.rows


def row_proportions(infos: list[StreamInfo], weights_in: str) -> list[Optional[float]]:
    """The row proportions that give the streams' ``proportion`` as shares of ``weights_in``.

    A stream's share of tokens is rows x tokens per row, so the rows must be in proportion
    ``p_i / (tokens per row)_i``; rescaled to the same sum as the requested ones. Other
    weights (repeat, choose, none) pass through: the config allows ``weights_in`` other
    than rows only when every stream has a proportion.
    """
    given = [i.spec.proportion for i in infos]
    if weights_in == 'rows' or any(p is None for p in given):
        return given
    raw = [p / units_per_row(i, weights_in) for p, i in zip(given, infos)]  # type: ignore[operator]
    scale = sum(given) / sum(raw) if sum(raw) > 0 else 0.0  # type: ignore[arg-type]
    return [r * scale for r in raw]


def make_streams(infos: list[StreamInfo], chooses: Optional[Any] = None,
                 weights_in: str = 'rows') -> list[Any]:
    """Fresh ``streaming.Stream`` objects, one per stream, in order: the one place they are built.

    ``StreamingDataset`` and the plan (which replays streaming's sampling) both take
    these, so what is planned is what is trained. ``chooses`` (rows per stream per epoch)
    replaces the configured weights when an exact epoch trims them; otherwise
    ``weights_in`` says what ``proportion`` is a share of (:func:`row_proportions` turns
    it into rows here).
    """
    from streaming import Stream
    if chooses is not None:
        return [Stream(remote=i.spec.remote, local=i.local, split=i.spec.split, choose=int(c))
                for i, c in zip(infos, chooses)]
    proportions = row_proportions(infos, weights_in)
    return [Stream(remote=i.spec.remote, local=i.local, split=i.spec.split, repeat=i.spec.repeat,
                   proportion=p, choose=i.spec.choose)
            for i, p in zip(infos, proportions)]


"""``foundrymix adopt``: existing MDS (LLM-Foundry's, streaming's) -> foundrymix datasets.

The shards' columns say what a source is (:data:`KINDS`). ``text`` and ``prompt``/``response``
take the pretrain/finetune paths; ``turns`` are packed from their ids; ``tokens`` windows are
joined in shard order and re-cut at their EOS (else BOS) ids with no tokenizer run, so the rows
equal ``convert pretrain`` of the raw corpus. docs/convert.md ("Adopting existing MDS").

The way back, ``foundrymix export DATASET --to-foundry OUT`` (:func:`export_to_foundry`): a pretrain
dataset as one ``tokens`` column, as LLM-Foundry's ``StreamingTextDataset`` reads it: each row's real
tokens, padding left out. Rows are checked first; OUT is renamed into place, never replaced.
Finetune datasets are refused (a ``tokens`` column cannot hold their loss spans).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Optional

import numpy as np

from foundrymix.convert.common import ConvertOptions, Setup, worker_state
from foundrymix.convert.driver import Converter, convert, parse_records
from foundrymix.convert.finetune import FINETUNE, FinetuneOptions, _chunk_examples, _ChunkExamples, _layout
from foundrymix.convert.output import check_can_create, check_output_dir
from foundrymix.convert.upload import parse_s3_url
from foundrymix.convert.paths import check_overlap, is_url, sub_out
from foundrymix.convert.pretrain import PRETRAIN, PretrainOptions, _ChunkTokens, _PretrainRows
from foundrymix.convert.mds_input import MdsSplit, download_datasets, find_splits, read_column_arrays
from foundrymix.convert.readers import BadRecord, Chunk
from foundrymix.errors import ExistsError, UserError
from foundrymix.format.foundry_tokens import document_rule
from foundrymix.format.schema import Manifest
from foundrymix.format.shards import INDEX_NAME, iter_shard_rows, read_index, shard_raw_bytes, stored_name
from foundrymix.tokenizer import describe_tokenizer

#: the column sets adopt reads, and what they are
KINDS = {
    'tokens': 'LLM-Foundry pretrain tokens (tokens: ndarray:int32)',
    'text': 'raw text (text: str)',
    'prompt_response': 'LLM-Foundry finetune text (prompt, response: str)',
    'turns': 'LLM-Foundry tokenized finetune (turns: json)',
}
#: the ``convert KIND --from-mds`` that reads each of :data:`KINDS`
COMMANDS = {'tokens': 'pretrain', 'text': 'pretrain', 'prompt_response': 'finetune', 'turns': 'finetune'}


def source_kind(split: MdsSplit) -> str:
    """Which of :data:`KINDS` a dataset is, from its columns; refuses anything else."""
    cols = split.columns
    if cols.get('tokens', '').startswith('ndarray:') or cols.get('tokens') == 'ndarray':
        return 'tokens'
    if cols.get('turns') == 'json':
        return 'turns'
    if cols.get('prompt') == 'str' and cols.get('response') == 'str':
        return 'prompt_response'
    if cols.get('text') == 'str':
        return 'text'
    if 'input_ids' in cols and 'loss_spans' in cols:
        raise UserError(f'{split.path}: already foundrymix rows (input_ids, loss_spans) without '
                        f'foundrymix.json; reconvert the raw corpus with `foundrymix convert`')
    have = ', '.join(f'{k}: {v}' for k, v in cols.items())
    raise UserError(f'{split.path}: columns {have} are not a kind adopt reads; it reads '
                    + '; '.join(KINDS.values()))


@dataclass
class TokenOptions(ConvertOptions):
    """Options of adopting token shards: where documents end in the stream (inferred)."""

    boundary: str = 'eos'  # eos: after each eos_id; bos: before each bos_id; none: one document
    boundary_id: Optional[int] = None
    source_seq_len: Optional[int] = None  # the source's window length, if all rows share one


def _encode_tokens(chunk: Chunk) -> _ChunkTokens:
    """Read one token shard (no tokenizer): its rows joined, ids checked, and the tokens up to each
    document end found (``doc_lens``, the first counted from the shard's start)."""
    w = worker_state()
    o: TokenOptions = w.options
    _, stream, row_lens = read_column_arrays(chunk.path, chunk.start, 'tokens', w.token_dtype,
                                             (o.tokenizer, w.vocab_size))
    # a document ends after each EOS, or just before each BOS; 'none': the stream is one document
    ends = (np.flatnonzero(stream == o.boundary_id) + (o.boundary == 'eos') if o.boundary != 'none'
            else np.zeros(0, dtype=np.int64))
    return _ChunkTokens(len(row_lens), len(ends), [], {}, stream, np.diff(ends, prepend=0))


class _TokenRows(_PretrainRows):
    """Feeds the joined stream to the pretrain row cutter with document ends found in the data.
    A document may run across shards: the first end in a shard counts from the open one."""

    def __init__(self, setup: Setup, options: TokenOptions, manifest: Manifest) -> None:
        super().__init__(setup, options, manifest)
        self.since_end = 0  # tokens after the last document end so far (the open document)

    def _open(self) -> int:
        c = self.cutter
        return len(c.rest) - int(c.rest_pieces.sum())

    def add(self, result: _ChunkTokens) -> Iterator[dict]:
        lens = result.doc_lens
        ended = int(lens.sum())  # tokens up to the chunk's last document end
        if len(lens):
            lens[0] += self._open()
        kept = lens[lens > 0]  # a BOS at the very start of the stream ends nothing
        self.counts.documents_read -= len(lens) - len(kept)
        self.since_end = len(result.tokens) - ended if len(lens) else self.since_end + len(result.tokens)
        yield from self._rows(result.tokens, kept)

    def flush(self) -> Iterator[dict]:
        """The last document has no end in the data (Foundry cut it): it ends the stream."""
        if self.since_end:
            self.counts.documents_read += 1
        rest = self._open()
        if rest:  # its tokens not yet in a row: one more piece for the tail
            yield from self._rows(np.zeros(0, dtype=self.dtype), np.asarray([rest], dtype=np.int64))

    def close(self) -> None:
        """Counts: documents written are those with a token in a row (the rest are the tail)."""
        super().close()
        c = self.counts
        c.documents_written = c.documents_read - (self.cutter.tail_documents if c.tail_tokens else 0)

    def progress(self, result: _ChunkTokens) -> tuple[int, int]:
        return len(result.doc_lens), len(result.tokens)


@dataclass
class AdoptArgs:
    """``foundrymix adopt`` as given: the source root, the output and the conversion options."""

    source: str
    out: str
    splits: tuple[str, ...] = ()  # only these (names as listed); default: every split found
    tokenizer: Optional[str] = None  # required: LLM-Foundry's shards do not record theirs
    max_seq_len: Optional[int] = None  # default: the source's window (tokens), else 2048
    chat_loss: str = 'all'  # turns: loss on every turn's labels, or the last turn's (Foundry's default)
    common: dict[str, Any] = field(default_factory=dict)  # ConvertOptions fields (workers, ...)
    command: Optional[str] = None  # `convert pretrain|finetune --from-mds`: only its COMMANDS; default: any
    origin: Optional[str] = None  # the s3:// URL ``source`` (a local copy) was copied from


def _sniff_tokens(split: MdsSplit, tokenizer: str) -> tuple[str, Optional[int], Optional[int], str]:
    """Where documents end: ``(boundary, id, window length of shard 0, statement)``, from the first
    separator in shard order: documents end after each EOS, or start at each BOS not after one."""
    info = describe_tokenizer(tokenizer)
    window: Optional[int] = None
    previous: Optional[int] = None  # the last token of the shards read so far
    for number in range(split.shards):
        _, stream, row_lens = read_column_arrays(split.path, number, 'tokens')
        if number == 0:
            lengths = set(row_lens.tolist())
            window = lengths.pop() if len(lengths) == 1 else None
        if previous is not None:
            stream = np.concatenate(([previous], stream))
        if not len(stream):
            continue
        rule, _ = document_rule(stream, info.eos_id, info.bos_id)
        where = f'shard {number}' + (f' of {split.name}' if split.name else '')
        if rule == 'eos':
            return 'eos', info.eos_id, window, (f'documents end after each EOS (id {info.eos_id}; '
                                                f'the first after the start is in {where})')
        if rule == 'bos':
            return 'bos', info.bos_id, window, (f'no EOS (id {info.eos_id}) between documents: '
                                                f'documents start at each BOS (id {info.bos_id}; '
                                                f'the first is in {where})')
        previous = int(stream[-1])
    return 'none', None, window, (f'neither EOS (id {info.eos_id}) nor BOS between tokens: the '
                                  f'stream is taken as one document (doc_lens only mark row ends)')


def adopt(args: AdoptArgs, progress: bool = False) -> list[tuple[MdsSplit, Manifest]]:
    """Adopt every split of ``args.source`` (or those named) into ``args.out``; one manifest each.
    Every split's output is checked before the first is written, so a refusal touches nothing."""
    if is_url(args.source):
        parse_s3_url(args.source, 'adopt')  # another store is refused before anything is copied
        with tempfile.TemporaryDirectory(prefix='foundrymix-adopt-') as staging:
            if progress:
                print(f'adopt {args.source}: copying its MDS datasets to {staging} first')
            download_datasets(args.source, staging, progress)
            return adopt(replace(args, source=staging, origin=args.source.rstrip('/')), progress)
    splits = find_splits(args.source)
    if args.splits:
        names = {s.name for s in splits}
        unknown = [n for n in args.splits if n not in names]
        if unknown:
            raise UserError(f'--split {unknown[0]}: not found in {args.source} (splits: '
                            f"{', '.join(s.name or '.' for s in splits)})")
        splits = [s for s in splits if s.name in args.splits]
    kinds = [source_kind(s) for s in splits]
    for s, k in zip(splits, kinds):
        if args.command and COMMANDS[k] != args.command:
            raise UserError(f'{s.path}: holds {KINDS[k]}; that is `foundrymix convert {COMMANDS[k]} --from-mds` '
                            f'(or `foundrymix adopt`)')
    if args.tokenizer is None:  # the demo tokenizer would be taken in silence (and 2048 with it)
        s, k = splits[0], kinds[0]
        what = ('which adopt tokenizes' if k in ('text', 'prompt_response') else
                'whose documents adopt finds by the EOS/BOS ids of the tokenizer')
        raise UserError(f'{s.path}: holds {KINDS[k]}, {what}; the shards do not record '
                        f'their tokenizer: pass --tokenizer NAME_OR_DIR, the one they were made with (a '
                        f'bundled name, a local tokenizer directory or a cached Hub name)')
    several = len(splits) > 1 or splits[0].name != ''
    outs = [sub_out(args.out, s.name) if several else args.out for s in splits]
    if progress:
        print(f'adopt {args.origin or args.source}: {len(splits)} MDS dataset(s)')
        for s, k in zip(splits, kinds):
            print(f'  {s.describe()} -> {KINDS[k]}')
    if not is_url(args.out):
        check_overlap([args.source], [], args.out)
    for target in outs:
        if not is_url(target):
            check_output_dir(os.path.abspath(target), bool(args.common.get('overwrite')))
    return [(s, _adopt_one(s, kind, target, args, progress)) for s, kind, target in zip(splits, kinds, outs)]


def _adopt_one(split: MdsSplit, kind: str, out: str, args: AdoptArgs, progress: bool) -> Manifest:
    path = split.path if args.origin is None else '/'.join(p for p in (args.origin, split.name) if p)
    source: dict[str, Any] = {'format': 'mds', 'path': path, 'split': split.name,
                              'columns': split.columns, 'rows': split.rows, 'kind': KINDS[kind]}
    common = dict(args.common, tokenizer=args.tokenizer, progress=progress, from_mds=True)
    if kind == 'tokens':
        boundary, boundary_id, window, how = _sniff_tokens(split, args.tokenizer)
        source['inferred'] = how
        L = args.max_seq_len or window or 2048
        if progress:
            print(f'  {split.name or "."}: no tokenizer run; {how}; rows of {L} tokens'
                  + (f' (the source windows are {window})' if window else ''))
        converter, options = TOKENS, TokenOptions(max_seq_len=L, boundary=boundary, boundary_id=boundary_id,
                                                  source_seq_len=window, **common)
    else:  # turns: already tokenized, with the special tokens Foundry's tokenizer call put in
        converter, cls = {'text': (PRETRAIN, PretrainOptions), 'prompt_response': (FINETUNE, FinetuneOptions),
                          'turns': (TURNS, FinetuneOptions)}[kind]
        extra = {'chat_loss': args.chat_loss} if kind == 'turns' else {}
        options = cls(max_seq_len=args.max_seq_len or 2048, **extra, **common)
    return convert(replace(converter, manifest_options=_adding(converter.manifest_options, source=source)),
                   [split.path], out, options)


def _turns(rec: dict, vocab: int, chat_loss: str, loss_on_prompt: bool
           ) -> list[tuple[list[int], bool]] | BadRecord:
    """A ``turns`` record as (ids, has loss) segments: each turn's ``input_ids`` (loss only with
    ``loss_on_prompt``) then its ``labels`` (loss on every turn, or the last with ``'last'``)."""
    turns = rec.get('turns')
    if not isinstance(turns, list) or not turns:
        return BadRecord('missing_field', "field 'turns': expected a non-empty list of "
                                          "{input_ids, labels}")
    segs: list[tuple[list[int], bool]] = []
    for i, turn in enumerate(turns):
        for key in ('input_ids', 'labels'):
            ids = turn.get(key) if isinstance(turn, dict) else None
            if not isinstance(ids, list) or not all(isinstance(x, int) and 0 <= x < vocab for x in ids):
                return BadRecord('bad_turns', f"field 'turns[{i}].{key}': expected a list of token ids "
                                              f"below the vocabulary size {vocab:,}")
        last = i == len(turns) - 1
        segs += [(turn['input_ids'], loss_on_prompt),
                 (turn['labels'], chat_loss == 'all' or last or loss_on_prompt)]
    return segs


def _encode_turns(chunk: Chunk) -> _ChunkExamples:
    """Already tokenized finetune examples of one shard, laid out as ``convert finetune`` does
    (no BOS/EOS added)."""
    w = worker_state()
    o: FinetuneOptions = w.options
    vocab = w.vocab_size
    read, examples = parse_records(chunk, ('turns',), lambda rec: _turns(rec, vocab, o.chat_loss, o.loss_on_prompt))
    laid_out = [(*_layout([len(ids) for ids, _ in segs], [loss for _, loss in segs], 0, False),
                 [ids for ids, _ in segs]) for segs in examples]
    return _chunk_examples(read, laid_out, o, w.token_dtype)


def _adding(base: Any, **extra: Any) -> Any:
    """Manifest options ``base`` with ``extra`` added (where the input came from, what was inserted)."""
    def options(o: Any, setup: Setup) -> dict[str, Any]:
        return dict(base(o, setup), **extra)
    return options


# adopted token ids: no separator was inserted, whatever ``--bos``/``--eos`` say
_AS_SOURCE = {'separators': {'bos': False, 'eos': False, 'as_source': True}}
TURNS = replace(FINETUNE, encode_chunk=_encode_turns, parallel='threads',
                manifest_options=_adding(FINETUNE.manifest_options, **_AS_SOURCE))
TOKENS = Converter(kind='pretrain', noun='documents', encode_chunk=_encode_tokens, parallel='threads',
                   builder=_TokenRows, manifest_options=_adding(lambda o, s: o.to_manifest(), **_AS_SOURCE),
                   tokenizes=False)


@dataclass(frozen=True)
class FoundryExport:
    """What an export wrote."""

    out: str
    rows: int
    tokens: int
    shards: int


def export_to_foundry(dataset: str, out: str, size_limit: int = 1 << 26) -> FoundryExport:
    """Write ``dataset`` (a local foundrymix pretrain dataset) to ``out`` as Foundry ``tokens`` MDS."""
    from streaming import MDSWriter

    manifest = Manifest.read(dataset)
    if manifest.kind != 'pretrain':
        raise UserError(f'{dataset}: a {manifest.kind} dataset: its rows carry loss spans and example '
                        f"boundaries that LLM-Foundry's tokens column cannot hold; --to-foundry writes "
                        f'pretrain datasets only (Foundry reads finetune data as prompt/response text)')
    if os.path.lexists(out):
        raise ExistsError(f'{out}: exists; give a new directory (an export never writes into or replaces '
                          f'an existing one)')
    check_can_create(out, '--to-foundry')  # else streaming's uploader fails in a traceback
    index = read_index(os.path.join(dataset, INDEX_NAME))
    partial = f'{out.rstrip(os.sep)}.partial-{os.getpid()}'
    rows = tokens = 0
    try:
        with MDSWriter(out=partial, columns={'tokens': f'ndarray:{manifest.token_dtype}'},
                       size_limit=size_limit) as writer:
            for shard in index['shards']:
                name = stored_name(shard)
                with open(os.path.join(dataset, name), 'rb') as f:
                    data = shard_raw_bytes(shard, f.read())
                for result in iter_shard_rows(data, shard, manifest.tokenizer.vocab_size, manifest.max_seq_len):
                    if result.problem is not None:
                        raise UserError(f'{os.path.join(dataset, name)}: row {result.row}: {result.problem}; '
                                        f'run `foundrymix verify {dataset}`')
                    real = int(np.asarray(result.value['doc_lens']).sum())  # the rest is padding
                    ids = np.ascontiguousarray(result.value['input_ids'][:real], dtype=manifest.token_dtype)
                    writer.write({'tokens': ids})
                    rows += 1
                    tokens += real
        shards = len(read_index(os.path.join(partial, INDEX_NAME))['shards'])
        os.rename(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return FoundryExport(out=out, rows=rows, tokens=tokens, shards=shards)

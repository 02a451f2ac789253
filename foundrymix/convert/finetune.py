"""``convert finetune``: prompt/response or chat examples -> decoder-only rows with loss masks.

An example is ``[BOS] + prompt + response + [EOS]``, prompt and response tokenized apart so the
loss boundary is a token boundary. Loss covers the response and EOS (or every token), never an
example's first token. Too long: dropped or truncated; an example with no loss token is dropped;
all counted in ``manifest.dropped``. Rows are packed first-fit, or one example per row, padded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import numpy as np

from foundrymix.convert.common import ConvertOptions, Setup, worker_state
from foundrymix.convert.paths import OutSpec
from foundrymix.convert.driver import Converter, RowBuilder, convert, parse_records
from foundrymix.convert.mapping import (Segments, Template, chat_segments, concat_ids, encode_texts, parse_template,
                                        read_fields)
from foundrymix.convert.pipeline import ChunkResult
from foundrymix.convert.readers import BadRecord, Chunk, get_string, plan_chunks, read_records
from foundrymix.format.schema import Manifest, encode_row

TOO_LONG = ('drop', 'truncate')
CHAT_LOSS = ('all', 'last')
#: used when the response field is missing (LLM-Foundry's name for the response)
RESPONSE_ALIAS = 'completion'
#: records of the first chunk looked at to tell chats from prompt/response examples
_SNIFF_RECORDS = 64

Example = tuple[np.ndarray, np.ndarray]  # (ids, flat loss spans)


@dataclass
class FinetuneOptions(ConvertOptions):
    """Options of ``convert finetune`` (see :class:`ConvertOptions` for the common ones)."""

    prompt_field: str = 'prompt'
    response_field: str = 'response'
    messages_field: str = 'messages'
    too_long: str = field(default='drop', metadata={'choices': TOO_LONG})
    loss_on_prompt: bool = False
    chat_loss: str = field(default='all', metadata={'choices': CHAT_LOSS})
    pack: bool = True
    pack_window: int = field(default=64, metadata={'positive': True})
    prompt_template: Optional[str] = None  # --prompt '{context}' (see mapping.py)
    response_template: Optional[str] = None  # --response ' {continuation}'


@dataclass
class _ChunkExamples(ChunkResult):
    """A worker's result: the kept examples of a chunk, in input order, back to back in
    ``tokens``; example ``i`` has ``span_counts[i]`` flat ``(start, end)`` pairs in ``spans``."""

    tokens: np.ndarray
    example_lens: np.ndarray
    spans: np.ndarray
    span_counts: np.ndarray
    lengths: np.ndarray  # of every assembled example, kept or not (for the summary)

    def examples(self) -> Iterator[Example]:
        """``(ids, flat spans)`` of each kept example: views into the chunk's arrays."""
        ends = np.cumsum(self.example_lens).tolist()
        span_ends = (2 * np.cumsum(self.span_counts)).tolist()
        start = span_start = 0
        for end, span_end in zip(ends, span_ends):
            yield self.tokens[start:end], self.spans[span_start:span_end]
            start, span_start = end, span_end


class Packer:
    """Deterministic first-fit packing: an example goes into the oldest open row with room, else a
    new one (past ``window`` open rows the oldest is written). Examples are never split; rows
    depend only on the input order."""

    def __init__(self, max_seq_len: int, window: int) -> None:
        self.max_seq_len = max_seq_len
        self.window = window
        self.open: list[list[tuple[np.ndarray, np.ndarray]]] = []
        self.used: list[int] = []

    def add(self, ids: np.ndarray, spans: np.ndarray) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        """Place one example; return the rows that are finished now."""
        n = len(ids)
        for r, used in enumerate(self.used):
            if used + n <= self.max_seq_len:
                self.open[r].append((ids, spans))
                self.used[r] += n
                return [self._close(r)] if self.used[r] == self.max_seq_len else []
        self.open.append([(ids, spans)])
        self.used.append(n)
        if n == self.max_seq_len:
            return [self._close(len(self.open) - 1)]
        return [self._close(0)] if len(self.open) > self.window else []

    def _close(self, r: int) -> list[tuple[np.ndarray, np.ndarray]]:
        self.used.pop(r)
        return self.open.pop(r)

    def flush(self) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        rows, self.open, self.used = self.open, [], []
        return rows


def _templates(o: FinetuneOptions) -> tuple[Optional[Template], Optional[Template]]:
    return parse_template(o.prompt_template, '--prompt'), parse_template(o.response_template, '--response')


def _segments(rec: dict, o: FinetuneOptions, tok: Any) -> Segments | BadRecord:
    """The example's text pieces with their loss flags, or why the record is unusable.
    With a ``--prompt``/``--response`` template, records are prompt/response examples."""
    ptemplate, rtemplate = _templates(o)
    if o.messages_field in rec and ptemplate is None and rtemplate is None:
        return chat_segments(rec[o.messages_field], o.messages_field, o.chat_loss, o.loss_on_prompt, tok)
    prompt = get_string(rec, o.prompt_field) if ptemplate is None else ptemplate.render(rec)
    if isinstance(prompt, BadRecord):
        return prompt
    rfield = o.response_field
    if rfield not in rec and RESPONSE_ALIAS in rec:
        rfield = RESPONSE_ALIAS
    response = get_string(rec, rfield) if rtemplate is None else rtemplate.render(rec)
    if isinstance(response, BadRecord):
        return response
    if not response:
        what = f"field '{rfield}'" if rtemplate is None else f'--response {rtemplate.source!r}'
        return BadRecord('empty_document', f'{what}: empty response')
    return [(prompt, o.loss_on_prompt), (response, True)]


def _layout(seg_lens: list[int], flags: list[bool], n_head: int, has_eos: bool
            ) -> tuple[int, list[tuple[int, int]]]:
    """Length and loss spans of ``[BOS] + segments + [EOS]``: spans merged, never on the first
    token. Takes lengths only, so a chunk's ids are concatenated once for all its examples."""
    spans: list[tuple[int, int]] = []
    pos = n_head
    for n, loss in zip(seg_lens, flags):
        start, pos = pos, pos + n
        if loss and pos > start:
            if spans and spans[-1][1] == start:
                spans[-1] = (spans[-1][0], pos)
            else:
                spans.append((start, pos))
    if has_eos:
        pos += 1
        if flags and flags[-1] and spans and spans[-1][1] == pos - 1:
            spans[-1] = (spans[-1][0], pos)
    if spans and spans[0][0] == 0:
        spans[0] = (1, spans[0][1])
        if spans[0][0] == spans[0][1]:
            spans.pop(0)
    return pos, spans


def _fit(n: int, spans: list[tuple[int, int]], o: FinetuneOptions,
         dropped: dict[str, int]) -> Optional[tuple[int, list[tuple[int, int]]]]:
    """Apply ``too_long`` and the no-loss rule to one example of ``n`` tokens: the length
    and spans to keep (its first tokens), or ``None`` (dropped, counted in ``dropped``)."""
    L = o.max_seq_len
    if n > L:
        if o.too_long == 'drop':
            dropped['too_long'] = dropped.get('too_long', 0) + 1
            return None
        dropped['truncated_tokens'] = dropped.get('truncated_tokens', 0) + n - L
        n = L
        spans = [(s, min(e, L)) for s, e in spans if s < L]
    if not spans:
        dropped['no_loss_tokens'] = dropped.get('no_loss_tokens', 0) + 1
        return None
    return n, spans


def _chunk_examples(read: ChunkResult, laid_out: list[tuple[int, list[tuple[int, int]], list[list[int] | np.ndarray]]],
                    o: FinetuneOptions, dtype: str) -> _ChunkExamples:
    """The examples that fit (:func:`_fit`), back to back in one token array (per-example
    arrays would cost more than the packing). ``laid_out``: each example's length, loss
    spans and id pieces."""
    parts: list[list[int] | np.ndarray] = []
    kept_lens: list[int] = []
    kept_spans: list[int] = []
    span_counts: list[int] = []
    for n, spans, pieces in laid_out:
        fit = _fit(n, spans, o, read.dropped)
        if fit is None:
            continue
        keep, spans = fit
        if keep == n:
            parts.extend(pieces)
        else:  # truncated: its first ``keep`` tokens
            parts.append(concat_ids(pieces, dtype)[:keep])
        kept_lens.append(keep)
        kept_spans.extend(x for span in spans for x in span)
        span_counts.append(len(spans))
    return _ChunkExamples(**vars(read),
                          tokens=concat_ids(parts, dtype),
                          example_lens=np.asarray(kept_lens, dtype=np.int64),
                          spans=np.asarray(kept_spans, dtype=np.int32),
                          span_counts=np.asarray(span_counts, dtype=np.int64),
                          lengths=np.asarray([n for n, _, _ in laid_out], dtype=np.int64))


def _encode_chunk(chunk: Chunk) -> _ChunkExamples:
    """Read, check, template and tokenize one chunk (runs in a worker)."""
    w = worker_state()
    o: FinetuneOptions = w.options
    fields = read_fields((o.prompt_field, o.response_field, RESPONSE_ALIAS, o.messages_field),
                         _templates(o), o.preprocess)
    read, examples_segs = parse_records(chunk, fields, lambda rec: _segments(rec, o, w.tok))
    flat = encode_texts(w.tok, [text for segs in examples_segs for text, _ in segs])
    head: list[int] = [] if w.bos_id is None else [w.bos_id]
    tail: list[int] = [] if w.eos_id is None else [w.eos_id]
    laid_out = []
    pos = 0
    for segs in examples_segs:
        seg_ids = flat[pos:pos + len(segs)]
        pos += len(segs)
        n, spans = _layout([len(x) for x in seg_ids], [loss for _, loss in segs], len(head), bool(tail))
        laid_out.append((n, spans, [head, *seg_ids, tail]))
    return _chunk_examples(read, laid_out, o, w.token_dtype)


class _FinetuneRows(RowBuilder):
    """Packs examples first-fit (or one per row) into padded rows and counts them."""

    def __init__(self, setup: Setup, options: FinetuneOptions, manifest: Manifest) -> None:
        self.manifest = manifest
        self.L = options.max_seq_len
        # without packing, each example is a row of its own: no row is kept open for the next
        self.packer = Packer(options.max_seq_len, options.pack_window if options.pack else 0)
        self.pad = setup.info.pad_id
        self.dtype = setup.token_dtype
        self.lengths: list[np.ndarray] = []

    def add(self, result: _ChunkExamples) -> Iterator[dict]:
        self.lengths.append(result.lengths)
        for ids, spans in result.examples():
            yield from self._rows(self.packer.add(ids, spans))

    def flush(self) -> Iterator[dict]:
        return self._rows(self.packer.flush())

    def _rows(self, rows: list[list[Example]]) -> Iterator[dict]:
        c = self.manifest.counts
        for examples in rows:  # padded; spans shifted to row positions
            lens = [len(x) for x, _ in examples]
            real = sum(lens)
            ids = np.full(self.L, self.pad, dtype=self.dtype)
            ids[:real] = np.concatenate([x for x, _ in examples])
            spans = np.concatenate([s + start for (_, s), start in zip(examples, np.cumsum([0, *lens[:-1]]))])
            c.rows += 1
            c.tokens += real
            c.pad_tokens += self.L - real
            c.loss_tokens += int(np.diff(spans.reshape(-1, 2), axis=1).sum())
            c.documents_written += len(examples)
            yield encode_row(ids, spans, lens, self.dtype)

    def fit_length(self, share: float) -> Optional[int]:
        """The smallest length that ``share`` of the examples (kept or dropped) fit in."""
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.int64)
        return int(np.quantile(lengths, share, method='higher')) if len(lengths) else None

    def progress(self, result: _ChunkExamples) -> tuple[int, ...]:
        """Records read (the bar's count), kept tokens, examples kept (written)."""
        return result.n_records, int(result.example_lens.sum()), len(result.example_lens)


def _manifest_options(options: FinetuneOptions, setup: Setup) -> dict[str, Any]:
    d = options.to_manifest()
    d['separators'] = {'bos': setup.bos_id is not None, 'eos': setup.eos_id is not None}
    d['chat_template'] = 'tokenizer' if setup.tokenizer.chat_template else 'plain'
    return d


def _default_parallel(setup: Setup, o: FinetuneOptions) -> str:
    """``threads`` for prompt/response examples, ``processes`` for chats or ``--preprocess``
    (Python holding the GIL), told from the first chunk's first records; same output either way."""
    if o.preprocess is not None:
        return 'processes'
    if any(_templates(o)):
        return 'threads'  # templates make every record a prompt/response example
    first = next(iter(plan_chunks(setup.inputs, o.chunk_bytes)), None)
    if first is None:
        return 'threads'
    _, records = read_records(first, (o.prompt_field, o.response_field, RESPONSE_ALIAS, o.messages_field))
    sample = [rec for _, _, rec in records[:_SNIFF_RECORDS] if isinstance(rec, dict)]
    chats = sum(o.messages_field in rec for rec in sample)
    return 'processes' if chats * 2 > len(sample) else 'threads'


# min_content: room for at least one prompt token and one response token
FINETUNE = Converter(kind='finetune', noun='examples', encode_chunk=_encode_chunk, parallel=_default_parallel,
                     builder=_FinetuneRows, manifest_options=_manifest_options, min_content=2)


def convert_finetune(inputs: list[str], out: 'OutSpec', options: FinetuneOptions) -> Manifest:
    """Convert finetuning data in ``inputs`` to MDS shards plus manifest in ``out``."""
    _templates(options)  # a bad template fails before any work
    return convert(FINETUNE, inputs, out, options)

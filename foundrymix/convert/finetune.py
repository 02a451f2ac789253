"""``convert finetune``: prompt/response or chat examples -> decoder-only rows with loss masks.

Example layout: ``[BOS] + prompt + response + [EOS]`` (BOS iff the tokenizer adds one by
default, overridable). Prompt and response are tokenized *separately* (no special
tokens) and concatenated, so the loss boundary is always a token boundary and the
response tokens are exactly ``tokenizer(response, add_special_tokens=False)``. Loss
spans cover the response tokens and the EOS (``loss_on_prompt``: every token). The
first token of an example is never a loss target: it would be predicted from the end
of the previous packed example.

Chats (a ``messages`` list of ``{role, content}``): rendered with the tokenizer's chat
template when it has one. The text is split into turns by rendering growing prefixes
of the conversation: an assistant turn is what ``messages[:i+1]`` adds to
``messages[:i]`` rendered with the generation prompt, so the template's assistant
header is not trained but the turn's end marker is. Without a chat template a plain
one is used: each message is ``"{role}: "`` (no loss) then ``"{content}\\n"`` (loss for
trained assistant turns). ``chat_loss='all'`` trains every assistant turn, ``'last'``
only the last. The final EOS has loss iff the last segment has.

Too long for ``max_seq_len``: ``too_long='drop'`` drops the example (``dropped.too_long``);
``'truncate'`` keeps its first ``max_seq_len`` tokens (``dropped.truncated_tokens`` counts
the tokens cut). An example left with no loss token is dropped (``dropped.no_loss_tokens``).

Packing (default): first-fit, in input order, into a window of at most ``pack_window``
open rows. Each example goes into the first open row (oldest first) with room for it;
if none has room a new row is opened, and if that makes more than ``pack_window``
open rows the oldest is written. A row that becomes exactly full is written at once;
at the end the open rows are written oldest first. Examples are never split, and the
rows depend only on the input order, not on the number of workers. ``pack=False``
writes one example per row. Rows are padded with the pad id; ``doc_lens`` holds the
example lengths.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from foundrymix.convert.common import ConvertOptions, Setup, prepare
from foundrymix.convert.encode import encode_texts
from foundrymix.convert.pipeline import (ChunkErrors, LineCounter, Progress, apply_error_policy,
                                         ordered_map)
from foundrymix.convert.readers import (BadRecord, Chunk, get_string, plan_chunks, read_records,
                                        type_name)
from foundrymix.convert.report import print_summary
from foundrymix.convert.writer import ShardWriter
from foundrymix.schema import Manifest, encode_row
from foundrymix.tokenizer import load_tokenizer

TOO_LONG = ('drop', 'truncate')
#: roles every chat template handles (see :func:`allowed_roles`)
CHAT_ROLES = ('system', 'user', 'assistant')
CHAT_LOSS = ('all', 'last')
#: used when the response field is missing (LLM-Foundry's name for the response)
RESPONSE_ALIAS = 'completion'
#: default ``parallel`` mode: rendering chat templates and assembling examples is Python
#: work that holds the GIL, so processes beat threads here (see
#: :mod:`foundrymix.convert.pipeline`)
FINETUNE_PARALLEL = 'processes'


@dataclass
class FinetuneOptions(ConvertOptions):
    """Options of ``convert finetune`` (see :class:`ConvertOptions` for the common ones)."""

    prompt_field: str = 'prompt'
    response_field: str = 'response'
    messages_field: str = 'messages'
    too_long: str = 'drop'
    loss_on_prompt: bool = False
    chat_loss: str = 'all'
    pack: bool = True
    pack_window: int = 64


Segments = list[tuple[str, bool]]  # (text, has loss)


@dataclass
class _ChunkExamples:
    """A worker's result: the examples of a chunk, encoded, in input order."""

    examples: list[tuple[np.ndarray, np.ndarray]]  # (ids, flat loss spans)
    n_lines: int
    n_records: int
    dropped: dict[str, int]
    errors: ChunkErrors = field(default_factory=ChunkErrors)


_worker: dict[str, Any] = {}


def _init(tokenizer: str, options: FinetuneOptions, bos_id: Optional[int], eos_id: Optional[int],
          token_dtype: str) -> None:
    _worker.update(tok=load_tokenizer(tokenizer), o=options, bos=bos_id, eos=eos_id, dtype=token_dtype)


def _segments(rec: dict, o: FinetuneOptions, tok: Any) -> Segments | BadRecord:
    """The example's text pieces with their loss flags, or why the record is unusable."""
    if o.messages_field in rec:
        return _chat_segments(rec[o.messages_field], o, tok)
    prompt = get_string(rec, o.prompt_field)
    if isinstance(prompt, BadRecord):
        return prompt
    rfield = o.response_field
    if rfield not in rec and RESPONSE_ALIAS in rec:
        rfield = RESPONSE_ALIAS
    response = get_string(rec, rfield)
    if isinstance(response, BadRecord):
        return response
    if not response:
        return BadRecord('empty_document', f"field '{rfield}': empty response")
    return [(prompt, o.loss_on_prompt), (response, True)]


def _chat_segments(messages: Any, o: FinetuneOptions, tok: Any) -> Segments | BadRecord:
    f = o.messages_field
    if not isinstance(messages, list) or not messages:
        return BadRecord('not_string' if not isinstance(messages, list) else 'empty_document',
                         f"field '{f}': expected a non-empty list of messages, got "
                         f"{type_name(messages) if not isinstance(messages, list) else 'an empty list'}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return BadRecord('not_string', f"field '{f}[{i}]': expected an object, got {type_name(m)}")
        for key in ('role', 'content'):
            value = get_string(m, key)
            if isinstance(value, BadRecord):
                return BadRecord(value.reason, f"field '{f}[{i}].{key}': {value.detail.split(': ', 1)[1]}")
    allowed = allowed_roles(tok)
    for m in messages:
        if m['role'] not in allowed:
            return BadRecord('unknown_role', f"field '{f}': unknown role {m['role']!r} "
                                             f"(allowed: {', '.join(allowed)})")
    assistant = [i for i, m in enumerate(messages) if m['role'] == 'assistant']
    if not assistant:
        return BadRecord('no_assistant', f"field '{f}': no assistant message")
    trained = set(assistant if o.chat_loss == 'all' else assistant[-1:])
    if tok.chat_template is None:
        segs: Segments = []
        for i, m in enumerate(messages):
            segs += [(f"{m['role']}: ", o.loss_on_prompt),
                     (m['content'] + '\n', o.loss_on_prompt or i in trained)]
        return segs
    return _template_segments(messages, trained, o.loss_on_prompt, tok)


def allowed_roles(tok: Any) -> tuple[str, ...]:
    """Roles a chat may use: system, user and assistant, plus tool where the template
    handles it (it names the role ``'tool'``) or the plain template is used (it renders
    any role as ``"{role}: "``).

    Why check: a misspelt or differently cased role (``USER``, ``wizard``) renders as some
    unintended text or, for ``Assistant``, silently drops the turn from the loss.
    """
    template = tok.chat_template
    if template is None or re.search(r"""['"]tool['"]""", str(template)):
        return CHAT_ROLES + ('tool',)
    return CHAT_ROLES


def _template_segments(messages: list[dict], trained: set[int], loss_on_prompt: bool,
                       tok: Any) -> Segments:
    def render(msgs: list[dict], gen: bool) -> str:
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    segs: Segments = []
    done = ''
    for i, m in enumerate(messages):
        if m['role'] == 'assistant':
            head = render(messages[:i], True)
            full = render(messages[:i + 1], False)
            if not head.startswith(done) or not full.startswith(head):
                raise ValueError('chat template is not prefix-stable; cannot locate assistant turns')
            segs += [(head[len(done):], loss_on_prompt), (full[len(head):], loss_on_prompt or i in trained)]
        else:
            full = render(messages[:i + 1], False)
            if not full.startswith(done):
                raise ValueError('chat template is not prefix-stable; cannot locate assistant turns')
            segs.append((full[len(done):], loss_on_prompt))
        done = full
    return segs


def _assemble(seg_ids: list[list[int]], flags: list[bool], bos: Optional[int],
              eos: Optional[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Concatenate segments with BOS/EOS; loss spans merged, never on the first token."""
    ids: list[int] = [] if bos is None else [bos]
    spans: list[tuple[int, int]] = []
    for part, loss in zip(seg_ids, flags):
        start = len(ids)
        ids.extend(part)
        if loss and part:
            if spans and spans[-1][1] == start:
                spans[-1] = (spans[-1][0], len(ids))
            else:
                spans.append((start, len(ids)))
    if eos is not None:
        ids.append(eos)
        if flags and flags[-1] and spans and spans[-1][1] == len(ids) - 1:
            spans[-1] = (spans[-1][0], len(ids))
    if spans and spans[0][0] == 0:
        spans[0] = (1, spans[0][1])
        if spans[0][0] == spans[0][1]:
            spans.pop(0)
    return ids, spans


def _encode_chunk(chunk: Chunk) -> _ChunkExamples:
    """Read, check, template and tokenize one chunk (runs in a worker)."""
    w = _worker
    o: FinetuneOptions = w['o']
    tok = w['tok']
    L = o.max_seq_len
    n_lines, records = read_records(chunk, (o.prompt_field, o.response_field, RESPONSE_ALIAS,
                                            o.messages_field))
    errors = ChunkErrors()
    examples_segs: list[Segments] = []
    for path, index, rec in records:
        segs = rec if isinstance(rec, BadRecord) else _segments(rec, o, tok)
        if isinstance(segs, BadRecord):
            errors.add(path, index, segs.reason, segs.detail)
            if o.on_error == 'raise':
                break
            continue
        examples_segs.append(segs)
    flat = encode_texts(tok, [text for segs in examples_segs for text, _ in segs])
    dropped: dict[str, int] = {}
    examples = []
    pos = 0
    for segs in examples_segs:
        ids, spans = _assemble(flat[pos:pos + len(segs)], [loss for _, loss in segs], w['bos'], w['eos'])
        pos += len(segs)
        if len(ids) > L:
            if o.too_long == 'drop':
                dropped['too_long'] = dropped.get('too_long', 0) + 1
                continue
            dropped['truncated_tokens'] = dropped.get('truncated_tokens', 0) + len(ids) - L
            ids = ids[:L]
            spans = [(s, min(e, L)) for s, e in spans if s < L]
        if not spans:
            dropped['no_loss_tokens'] = dropped.get('no_loss_tokens', 0) + 1
            continue
        examples.append((np.asarray(ids, dtype=w['dtype']), np.asarray(spans, dtype=np.int32).reshape(-1)))
    return _ChunkExamples(examples, n_lines, len(records), dropped, errors)


class Packer:
    """Deterministic first-fit packing into a bounded window of open rows (module docstring)."""

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


def build_row(examples: list[tuple[np.ndarray, np.ndarray]], max_seq_len: int, pad_id: int,
              token_dtype: str) -> dict[str, np.ndarray]:
    """One padded MDS row from packed examples (spans shifted to row positions)."""
    ids = np.full(max_seq_len, pad_id, dtype=token_dtype)
    spans, lens, pos = [], [], 0
    for ex_ids, ex_spans in examples:
        ids[pos:pos + len(ex_ids)] = ex_ids
        spans.append(ex_spans + pos)
        lens.append(len(ex_ids))
        pos += len(ex_ids)
    return encode_row(ids, np.concatenate(spans), lens, token_dtype)


def convert_finetune(inputs: list[str], out: str, options: FinetuneOptions) -> Manifest:
    """Convert finetuning data in ``inputs`` to MDS shards plus manifest in ``out``."""
    if options.too_long not in TOO_LONG:
        raise ValueError(f"--too-long must be one of {', '.join(TOO_LONG)}, got {options.too_long!r}")
    if options.chat_loss not in CHAT_LOSS:
        raise ValueError(f"--chat-loss must be one of {', '.join(CHAT_LOSS)}, got {options.chat_loss!r}")
    if options.pack_window < 1:
        raise ValueError(f'pack_window must be >= 1, got {options.pack_window}')
    # room for at least one prompt token and one response token
    setup = prepare(inputs, out, options, min_content=2)
    opts = options.to_manifest()
    opts['separators'] = {'bos': setup.bos_id is not None, 'eos': setup.eos_id is not None}
    opts['chat_template'] = 'tokenizer' if setup.tokenizer.chat_template else 'plain'
    manifest = Manifest(kind='finetune', max_seq_len=options.max_seq_len, token_dtype=setup.token_dtype,
                        tokenizer=setup.info, inputs=setup.inputs, options=opts)
    seconds = run_finetune(setup, out, options, manifest)
    if options.progress:
        print_summary(manifest, out, seconds)
    return manifest


def run_finetune(setup: Setup, out: str, options: FinetuneOptions, manifest: Manifest) -> float:
    """Stream chunks through the workers, pack, write shards and fill ``manifest``."""
    L = options.max_seq_len
    c = manifest.counts
    packer = Packer(L, options.pack_window)
    lines = LineCounter()
    progress = Progress(options.progress, 'convert finetune')
    pad = setup.info.pad_id

    def write(rows: list[list[tuple[np.ndarray, np.ndarray]]]) -> None:
        for examples in rows:
            row = build_row(examples, L, pad, setup.token_dtype)
            writer.write(row)
            real = int(row['doc_lens'].sum())
            c.rows += 1
            c.tokens += real
            c.pad_tokens += L - real
            c.loss_tokens += int(np.diff(row['loss_spans'].reshape(-1, 2), axis=1).sum())
            c.documents_written += len(examples)

    initargs = (options.tokenizer, options, setup.bos_id, setup.eos_id, setup.token_dtype)
    chunks = plan_chunks(setup.inputs, options.chunk_bytes)
    with ordered_map(_encode_chunk, chunks, setup.workers, _init, initargs,
                     mode=options.parallel or FINETUNE_PARALLEL) as results, \
            ShardWriter(out, L, setup.token_dtype, overwrite=options.overwrite,
                        compression=options.compression, size_limit=options.size_limit,
                        hashes=options.hash_algorithms) as writer:
        try:
            for chunk, res in results:
                apply_error_policy(chunk, res.errors, lines.first_line(chunk, res.n_lines),
                                   options.on_error, manifest)
                c.documents_read += res.n_records
                for reason, n in res.dropped.items():
                    manifest.dropped[reason] = manifest.dropped.get(reason, 0) + n
                for ids, spans in res.examples:
                    write(packer.add(ids, spans) if options.pack else [[(ids, spans)]])
                progress.update(len(res.examples), sum(len(ids) for ids, _ in res.examples))
            write(packer.flush())
        finally:
            seconds = progress.close()
        if c.documents_read == 0:
            raise ValueError(f'no examples found in {len(setup.inputs)} input file(s)')
        writer.finish(manifest)
    return seconds

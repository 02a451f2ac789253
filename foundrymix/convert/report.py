"""Human-readable tables of a manifest: the end-of-conversion summary and ``inspect``."""

from __future__ import annotations

import sys
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

from foundrymix.errors import FoundrymixError, UserError
from foundrymix.format.schema import Manifest


def manifest_table(manifest: Manifest, title: str, seconds: Optional[float] = None) -> Table:
    """Counts, drops, skips and identity of a conversion as a two-column table."""
    c = manifest.counts
    table = Table(title=title, show_header=False, title_justify='left')
    table.add_column('what', style='bold')
    table.add_column('value', justify='right')
    t = manifest.tokenizer
    rows = [
        ('kind', manifest.kind),
        ('schema version', str(manifest.schema_version)),
        ('max_seq_len', f'{manifest.max_seq_len:,}'),
        ('token dtype', manifest.token_dtype),
        ('tokenizer', f'{t.name} (vocab {t.vocab_size:,}, bos {t.bos_id}, eos {t.eos_id}, '
                      f'pad {t.pad_id})'),
        ('fingerprint', t.fingerprint[:16]),
        ('inputs', f'{len(manifest.inputs):,} file(s)'),
        ('rows', f'{c.rows:,}'),
        ('tokens (real)', f'{c.tokens:,}'),
        ('pad tokens', f'{c.pad_tokens:,}'),
        ('loss tokens', f'{c.loss_tokens:,}'),
        ('documents read', f'{c.documents_read:,}'),
        ('documents written', f'{c.documents_written:,}'),
    ]
    if manifest.kind == 'pretrain':
        rows.append(('tail tokens (not written)', f'{c.tail_tokens:,}'))
    rows += [(f'dropped: {k}', f'{v:,}') for k, v in sorted(manifest.dropped.items())]
    for reason, n in sorted(manifest.skipped.items()):
        rows.append((f'skipped: {reason}', f'{n:,}'))
        at = manifest.skipped_at.get(reason, [])
        if at:
            more = f'\n(+{n - len(at):,} more)' if n > len(at) else ''
            rows.append(('  first at', '\n'.join(at) + more))
    if seconds is not None:
        rows.append(('time', f'{seconds:,.1f} s ({c.tokens / max(seconds, 1e-9):,.0f} tok/s)'))
    for what, value in rows:
        table.add_row(what, value)
    return table


#: share of examples dropped as too long above which the summary warns
TOO_LONG_WARN = 0.05


def separators_note(manifest: Manifest) -> str:
    """Whether BOS/EOS were inserted, and why (the tokenizer's default or an override)."""
    sep = manifest.options.get('separators', {})
    t = manifest.tokenizer
    noun = 'document' if manifest.kind == 'pretrain' else 'example'
    if sep.get('as_source'):  # adopted token ids: nothing was inserted, whatever the options say
        source = manifest.options.get('source', {})
        how = source.get('inferred') or "each example's turns as LLM-Foundry's tokenizer call made them"
        return f'separators: none inserted: the source\'s token ids are kept as they are ({how}).'
    bos, eos = bool(sep.get('bos')), bool(sep.get('eos'))
    if manifest.options.get('bos') is not None:
        bos_why = 'set by --bos/--no-bos'
    elif bos or not t.add_bos:
        bos_why = 'the tokenizer adds BOS' if t.add_bos else 'the tokenizer adds no BOS'
    else:
        bos_why = 'not inserted'
    eos_why = '' if eos else ' (--no-eos)' if manifest.options.get('eos') is False else ' (not inserted)'
    return (f'separators: BOS inserted before each {noun}: {"yes" if bos else "no"}'
            f'{f" (id {t.bos_id})" if bos else ""} ({bos_why}); EOS inserted after each {noun}: '
            f'{"yes" if eos else "no"}{f" (id {t.eos_id})" if eos else eos_why}.')


def _left_out(manifest: Manifest) -> str:
    n_skipped = sum(manifest.skipped.values())
    parts = [f'{n:,} dropped ({k})' for k, n in sorted(manifest.dropped.items()) if k != 'truncated_tokens']
    if n_skipped:
        parts.append(f'{n_skipped:,} skipped as bad records')
    return ('; ' + ', '.join(parts)) if parts else ''


def documents_note(manifest: Manifest) -> str:
    """Documents (examples) read against written, and where the difference went."""
    c = manifest.counts
    if manifest.kind != 'pretrain':
        return f'examples: {c.documents_read:,} read, {c.documents_written:,} written{_left_out(manifest)}.'
    tail_docs = c.documents_read - c.documents_written - sum(manifest.skipped.values()) - \
        sum(v for k, v in manifest.dropped.items() if k != 'truncated_tokens')
    return (f'documents: {c.documents_read:,} read, {c.documents_written:,} written (wholly or in part)'
            f'{_left_out(manifest)}. The last {c.tail_tokens:,} tokens, after the last full row of '
            f'{manifest.max_seq_len:,}, are not written (rows are never padded): {tail_docs:,} '
            f'document(s) lie wholly in them.')


def too_long_warning(manifest: Manifest, fit_95: Optional[int]) -> Optional[str]:
    """A warning when more than ``TOO_LONG_WARN`` of the examples were dropped as too long,
    naming both ways out and what each does to the data."""
    n, read = manifest.dropped.get('too_long', 0), manifest.counts.documents_read
    if not read or n / read <= TOO_LONG_WARN:
        return None
    L = manifest.max_seq_len
    to = f' to {fit_95:,} (fits 95 % of them)' if fit_95 and fit_95 > L else ''
    return (f'warning: {100 * n / read:.1f} % of examples ({n:,} of {read:,}) were dropped as longer '
            f'than --max-seq-len {L:,}. To keep them, raise --max-seq-len{to}: every token is kept, '
            f'in longer rows; or pass --too-long truncate: only their first {L:,} tokens are kept and '
            f'the rest are lost (counted as dropped: truncated_tokens).')


class EmptyOutputError(FoundrymixError, ValueError):
    """A conversion would write no rows; nothing is published (see :func:`check_rows`)."""


def _no_rows_reasons(manifest: Manifest) -> list[tuple[str, str]]:
    """(what happened, what to do) for each reason a conversion has no rows."""
    L, c, opts = manifest.max_seq_len, manifest.counts, manifest.options
    reasons = []
    n_skipped = sum(manifest.skipped.values())
    if n_skipped:
        first = next(iter(manifest.skipped))
        at = manifest.skipped_at.get(first, [])
        where = f'; first at {at[0]}: {first}' if at else f'; {first}'
        reasons.append((f'{n_skipped:,} skipped as bad records (--on-error skip{where})',
                        'Fix them, or convert other input'))
    n = manifest.dropped.get('preprocess_skipped', 0)
    if n:
        fn = opts.get('preprocess')
        reasons.append((f'{n:,} skipped by --preprocess {fn} (it returned None)',
                        'Check that it returns the record (a dict) for the records to keep'))
    n = manifest.dropped.get('too_long', 0)
    if n:
        reasons.append((f'{n:,} dropped as longer than --max-seq-len {L:,} (--too-long drop)',
                        f'Raise --max-seq-len (keeps every token), or pass --too-long truncate (keeps '
                        f'only the first {L:,} tokens of each such example; the rest are lost)'))
    n = manifest.dropped.get('no_loss_tokens', 0)
    if n and manifest.dropped.get('truncated_tokens', 0):
        reasons.append((f'{n:,} dropped with no loss token left (--too-long truncate keeps the first '
                        f'{L:,} tokens: responses beyond them are cut off)',
                        'Raise --max-seq-len so that the responses fit'))
    elif n:
        reasons.append((f'{n:,} dropped with no loss token (an empty response, or a chat with no '
                        f'assistant turn to train on)',
                        'Check --response-field/--response, or --messages-field and --chat-loss'))
    if manifest.kind == 'pretrain' and c.tail_tokens:
        what = (f'all {c.tail_tokens:,} tokens are' if not reasons else
                f'the other documents hold {c.tail_tokens:,} tokens,')
        reasons.append((f'{what} fewer than one row of --max-seq-len {L:,} (rows are never padded)',
                        f'Use --max-seq-len {c.tail_tokens:,} or less, or convert more input'))
    return reasons


def check_rows(manifest: Manifest, n_inputs: int, holdout: Any = None) -> None:
    """Refuse to publish a conversion that read nothing (or nothing on its ``--holdout`` side) or
    made no rows, saying why by reason and what to do."""
    noun = 'documents' if manifest.kind == 'pretrain' else 'examples'
    if not manifest.counts.documents_read:
        if holdout is None:
            raise UserError(f'no {noun} found in {n_inputs} input file(s)')
        if holdout.side == 'eval':
            raise UserError(f'--holdout {holdout.spec}: no {noun} fell in the eval split; give a larger '
                            f'fraction, or a number of {noun}')
        raise UserError(f'--holdout {holdout.spec}: every {noun} fell in the eval split; give a smaller fraction')
    if manifest.counts.rows:
        return
    reasons = _no_rows_reasons(manifest)
    what = '; '.join(r for r, _ in reasons) or 'none made a row'
    todo = '; '.join(a for _, a in reasons)
    raise EmptyOutputError(f'no rows to write, so nothing was published: {manifest.counts.documents_read:,} '
                           f'{noun} read; {what}.{f" {todo}" if todo else ""}')


def print_summary(manifest: Manifest, out: str, seconds: float, fit_95: Optional[int] = None,
                  uploaded: Optional[str] = None) -> None:
    """The table printed at the end of a conversion (on stderr), then plain sentences (warnings in
    yellow). ``fit_95``: the length 95 % of the examples fit in, if known; ``uploaded``: the upload
    summary."""
    console = Console(file=sys.stderr)
    console.print(manifest_table(manifest, f'foundrymix convert -> {out}', seconds))
    notes = [separators_note(manifest), documents_note(manifest)]
    inferred = manifest.options.get('source', {}).get('inferred', '')
    if inferred.startswith('neither EOS'):  # adopt found no separator: a wrong tokenizer looks the same
        notes.append(f'warning: {inferred.split(":")[0]} of tokenizer {manifest.tokenizer.name!r} in the shards, '
                     f'so every row is one document. If the documents had separators, they were not its single '
                     f'EOS/BOS ids: the shards were made with another tokenizer (pass it with --tokenizer) or '
                     f'with an --eos_text/--bos_text of several ids (adopt finds single ids only).')
    notes += [too_long_warning(manifest, fit_95)] + ([uploaded[0].upper() + uploaded[1:] + '.'] if uploaded else [])
    for note in filter(None, notes):
        style = 'yellow' if note.startswith('warning:') else None
        console.print(note, style=style, soft_wrap=True, markup=False, highlight=False)

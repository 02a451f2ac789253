"""Human-readable tables of a manifest: the end-of-conversion summary and ``inspect``."""

from __future__ import annotations

import sys
from typing import Optional

from rich.console import Console
from rich.table import Table

from foundrymix.schema import Manifest


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


def print_summary(manifest: Manifest, out: str, seconds: float) -> None:
    """The table printed at the end of a conversion (on stderr, like the progress bar)."""
    Console(file=sys.stderr).print(manifest_table(manifest, f'foundrymix convert -> {out}', seconds))

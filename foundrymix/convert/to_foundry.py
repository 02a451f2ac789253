"""``foundrymix export DATASET --to-foundry OUT``: a pretrain dataset as LLM-Foundry token shards.

OUT has one ``tokens`` column, as LLM-Foundry's ``StreamingTextDataset`` reads: each row's real
tokens, padding left out. Rows are checked first; OUT is renamed into place, never replaced.
Finetune datasets are refused (a ``tokens`` column cannot hold their loss spans).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import numpy as np

from foundrymix.convert.output import check_can_create
from foundrymix.errors import ExistsError, UserError
from foundrymix.format.schema import Manifest
from foundrymix.format.shards import INDEX_NAME, iter_shard_rows, read_index, shard_raw_bytes, stored_name


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

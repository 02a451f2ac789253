"""Synthetic foundrymix streams whose every token says where it came from.

Why synthetic: the mixer tests must not depend on the converters (written in parallel)
and must check each sample's identity. Row ``r`` of a stream tagged ``t`` starts with
``[TAG_BASE + t, r]``, so a decoded sample names its stream and row; finetune rows are
two packed prompt/response examples plus padding, with loss spans over the responses.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Optional

import numpy as np

from foundrymix.convert.writer import ShardWriter
from foundrymix.format.schema import Counts, Manifest, TokenizerInfo, encode_row

TAG_BASE = 7000
MAX_SEQ_LEN = 32


@functools.lru_cache(maxsize=1)
def demo_tokenizer_info() -> TokenizerInfo:
    from foundrymix.tokenizer import load_tokenizer, tokenizer_info
    return tokenizer_info(load_tokenizer('foundrymix-bpe-8k'))


def other_tokenizer_info() -> TokenizerInfo:
    return dataclasses.replace(demo_tokenizer_info(), name='other-bpe', fingerprint='x' * 64)


def pretrain_row(tag: int, r: int, max_seq_len: int) -> tuple[np.ndarray, list, list]:
    """Full row, loss on every token, two documents (split point varies with ``r``)."""
    ids = (np.arange(max_seq_len) * 7 + r) % 500 + 1000
    ids[0], ids[1] = TAG_BASE + tag, r
    first = max_seq_len // 2 + r % 3
    return ids, [(0, max_seq_len)], [first, max_seq_len - first]


def finetune_layout(r: int, max_seq_len: int) -> tuple[list[tuple[int, int]], list[int]]:
    """(loss spans, doc_lens) of finetune row ``r``: two packed examples, then padding."""
    pa, ra = 3 + r % 4, 2 + r % 5
    pb, rb = 4, 3 + r % 3
    a = pa + ra
    spans = [(pa, a), (a + pb, a + pb + rb)]
    doc_lens = [a, pb + rb]
    assert sum(doc_lens) <= max_seq_len
    return spans, doc_lens


def finetune_row(tag: int, r: int, max_seq_len: int, pad_id: int) -> tuple[np.ndarray, list, list]:
    spans, doc_lens = finetune_layout(r, max_seq_len)
    n_real = sum(doc_lens)
    ids = np.full(max_seq_len, pad_id, dtype=np.int64)
    ids[:n_real] = (np.arange(n_real) * 11 + r) % 500 + 2000
    ids[0], ids[1] = TAG_BASE + tag, r
    return ids, spans, doc_lens


def build_stream(out: str, kind: str, rows: int, tag: int, max_seq_len: int = MAX_SEQ_LEN,
                 tokenizer: Optional[TokenizerInfo] = None, size_limit: int = 1 << 11,
                 schema_version: Optional[int] = None) -> Manifest:
    """Write ``rows`` synthetic rows of ``kind`` to ``out`` (several small shards) with a manifest.

    The row number each row carries as a token wraps at 8000, inside the demo vocabulary, so
    a benchmark can build large streams too (rows below 8000 are unchanged)."""
    tok = tokenizer or demo_tokenizer_info()
    counts = Counts()
    with ShardWriter(out, max_seq_len, 'uint16', size_limit=size_limit) as w:
        for r in range(rows):
            if kind == 'pretrain':
                ids, spans, doc_lens = pretrain_row(tag, r % 8000, max_seq_len)
            else:
                ids, spans, doc_lens = finetune_row(tag, r % 8000, max_seq_len, tok.pad_id)
            w.write(encode_row(ids, spans, doc_lens, 'uint16'))
            counts.rows += 1
            counts.tokens += sum(doc_lens)
            counts.pad_tokens += max_seq_len - sum(doc_lens)
            counts.loss_tokens += sum(e - s for s, e in spans)
            counts.documents_read += len(doc_lens)
            counts.documents_written += len(doc_lens)
        manifest = Manifest(kind=kind, max_seq_len=max_seq_len, token_dtype='uint16',
                            tokenizer=tok, counts=counts, inputs=[f'synthetic-{tag}'])
        if schema_version is not None:
            manifest.schema_version = schema_version
        w.finish(manifest)
    return manifest


def build_three(root: str, rows: tuple[int, int, int] = (120, 80, 60)) -> dict[str, str]:
    """The standard 3-stream mix: two pretrain streams and one finetune stream."""
    dirs = {}
    for tag, (name, kind, n) in enumerate(zip(('arxiv', 'wiki', 'dolly'),
                                              ('pretrain', 'pretrain', 'finetune'), rows)):
        dirs[name] = os.path.join(root, name)
        build_stream(dirs[name], kind, n, tag)
    return dirs


def loader_dict(dirs: dict[str, str], weights: dict[str, dict[str, Any]], **extra: Any) -> dict:
    streams = {name: {'local': path, **weights.get(name, {})} for name, path in dirs.items()}
    return {'streams': streams, **extra}


def identity(sample_input_ids: np.ndarray) -> tuple[int, int]:
    """(stream tag, row index) encoded in a row's first two tokens."""
    return int(sample_input_ids[0]) - TAG_BASE, int(sample_input_ids[1])


def read_epoch(config: dict, batch_size: int) -> list[dict]:
    """Every batch of one epoch of the loader ``config`` (tensors cloned), the loader released
    afterwards (its shared memory and cache claims go with it)."""
    import gc

    from foundrymix.loader.mixer import StreamMixer
    loader = StreamMixer.from_dict(config).build_dataloader(batch_size=batch_size)
    batches = [{k: v.clone() for k, v in b.items()} for b in loader]
    del loader
    gc.collect()
    return batches


#: a training YAML over the three streams of :func:`build_three` (repeat 1, 2.5, 0.5)
PLAN_YAML = '''
variables:
  root: {root}
global_train_batch_size: 8
max_duration: {duration}
max_seq_len: 32
model: {{type: llama, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1,
         num_attention_heads: 2, num_key_value_heads: 2, max_position_embeddings: 32}}
train_loader:
  streams:
    arxiv:
      local: ${{variables.root}}/arxiv
      repeat: 1
    wiki:
      local: ${{variables.root}}/wiki
      repeat: 2.5
    dolly:
      local: ${{variables.root}}/dolly
      repeat: 0.5
  shuffle_seed: 17
'''


def write_yaml(tmp_path, root, duration='3ep'):
    path = tmp_path / 'run.yaml'
    path.write_text(PLAN_YAML.format(root=root, duration=duration))
    return str(path)

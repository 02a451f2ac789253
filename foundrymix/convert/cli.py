"""``foundrymix convert pretrain|finetune``: argument parsing only; the work is in the modules."""

from __future__ import annotations

import argparse
from typing import Any

from foundrymix.convert.common import ON_ERROR
from foundrymix.convert.finetune import CHAT_LOSS, TOO_LONG, FinetuneOptions, convert_finetune
from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain
from foundrymix.tokenizer import DEMO_TOKENIZER


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument('inputs', nargs='+', metavar='INPUT',
                   help='files, globs or directories: .jsonl[.gz|.zst], .txt (one document per '
                        'file), .parquet, or datasets saved with save_to_disk')
    p.add_argument('-o', '--out', required=True, help='output directory (must be empty or absent)')
    p.add_argument('--tokenizer', default=DEMO_TOKENIZER,
                   help=f'bundled name, local tokenizer dir, SentencePiece .model, or cached name '
                        f'(offline; default {DEMO_TOKENIZER})')
    p.add_argument('--max-seq-len', type=int, default=2048, help='tokens per row (default 2048)')
    p.add_argument('--workers', type=int, default=0, help='worker processes (default 0 = all cores)')
    p.add_argument('--overwrite', action='store_true', help='replace a non-empty output directory')
    p.add_argument('--on-error', choices=ON_ERROR, default='raise',
                   help='bad records: stop with an error naming file, line and field (raise), or '
                        'skip them and count each by reason in the manifest (skip)')
    p.add_argument('--bos', action=argparse.BooleanOptionalAction, default=None,
                   help='BOS before each document/example (default: iff the tokenizer adds BOS)')
    p.add_argument('--eos', action=argparse.BooleanOptionalAction, default=True,
                   help='EOS after each document/example (default: on)')
    p.add_argument('--compression', default=None, help='MDS shard compression, e.g. zstd')
    p.add_argument('--size-limit', default='64mb', help='MDS shard size limit (default 64mb)')
    p.add_argument('--no-progress', dest='progress', action='store_false',
                   help='no progress bar or summary table')


def _options(cls: type, args: argparse.Namespace) -> Any:
    return cls(**{k: getattr(args, k) for k in cls.__dataclass_fields__ if hasattr(args, k)})


def _run_pretrain(args: argparse.Namespace) -> int:
    convert_pretrain(args.inputs, args.out, _options(PretrainOptions, args))
    return 0


def _run_finetune(args: argparse.Namespace) -> int:
    convert_finetune(args.inputs, args.out, _options(FinetuneOptions, args))
    return 0


def register(subparsers: Any) -> None:
    convert = subparsers.add_parser('convert', help='convert corpora to foundrymix MDS shards')
    sub = convert.add_subparsers(dest='convert_kind', required=True, metavar='KIND')

    p = sub.add_parser('pretrain', help='documents -> rows of exactly --max-seq-len tokens',
                       description='Tokenize documents, join them with [BOS] doc [EOS], cut rows of '
                                   'exactly --max-seq-len tokens (the tail is counted in the manifest).')
    _common(p)
    p.add_argument('--text-field', default='text', help='JSON/column field with the text (default text)')
    p.set_defaults(func=_run_pretrain)

    f = sub.add_parser('finetune', help='prompt/response or chat examples -> packed rows with loss masks',
                       description='Decoder-only examples [BOS] prompt response [EOS], loss on the '
                                   'response; packed first-fit into full rows (or padded).')
    _common(f)
    f.add_argument('--prompt-field', default='prompt')
    f.add_argument('--response-field', default='response', help="(a 'completion' field is accepted too)")
    f.add_argument('--messages-field', default='messages', help='chat field: list of {role, content}')
    f.add_argument('--too-long', choices=TOO_LONG, default='drop',
                   help='examples longer than --max-seq-len: drop (default) or truncate')
    f.add_argument('--loss-on-prompt', action='store_true', help='loss on prompt tokens too')
    f.add_argument('--chat-loss', choices=CHAT_LOSS, default='all',
                   help='chats: loss on every assistant turn (all) or only the last')
    f.add_argument('--no-pack', dest='pack', action='store_false',
                   help='one example per row, padded (default: first-fit packing)')
    f.add_argument('--pack-window', type=int, default=64, help='open rows kept while packing (default 64)')
    f.set_defaults(func=_run_finetune)

"""``foundrymix convert pretrain|finetune``: argument parsing only; the work is in the modules."""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import re
import sys
from typing import Any, Iterator, Optional

from foundrymix.convert.common import ENGINES, ON_ERROR
from foundrymix.convert.finetune import CHAT_LOSS, TOO_LONG, FinetuneOptions, convert_finetune
from foundrymix.convert.paths import is_url
from foundrymix.convert.pipeline import PARALLEL_MODES
from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain
from foundrymix.errors import UserError
from foundrymix.tokenizer import DEMO_TOKENIZER


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument('inputs', nargs='+', metavar='INPUT',
                   help='files, globs or directories: .jsonl/.ndjson[.gz|.zst], .txt (one document '
                        'per file), .parquet, or datasets saved with save_to_disk; .json (JSON '
                        'Lines) only when named or globbed as *.json. Directories skip earlier '
                        'outputs, hidden entries and --out')
    p.add_argument('-o', '--out', required=True,
                   help='local output directory (empty or absent, or a foundrymix dataset with '
                        '--overwrite; never an input or beside one), or s3://bucket/prefix (empty '
                        'unless --overwrite): uploaded as shards finish, index.json last, so readers '
                        'never see a partial dataset; credentials, endpoint and retries as for boto3 '
                        '(docs/s3.md)')
    p.add_argument('--keep-local', metavar='DIR', default=None,
                   help='with --out s3://...: also keep a complete local copy in DIR (same rules as a '
                        'local --out); without it shards are staged in the temp dir ($TMPDIR) and '
                        'deleted once uploaded')
    p.add_argument('--tokenizer', default=None,
                   help=f'bundled name, local tokenizer dir, SentencePiece .model, or cached name '
                        f'(offline; default {DEMO_TOKENIZER}; with --from-mds required)')
    p.add_argument('--max-seq-len', type=int, default=None,
                   help='tokens per row (default 2048; with --from-mds, token shards: their rows\' length)')
    p.add_argument('--split', metavar='NAME', default=None,
                   help='the split of a DatasetDict saved to disk (save_to_disk) to convert; one with '
                        'several splits is refused without it (a test split would become training '
                        'data): convert each split into an --out of its own. With --from-mds: the MDS '
                        'split to adopt, as `adopt --split`')
    p.add_argument('--from-mds', action='store_true',
                   help='INPUT is an existing MDS dataset (LLM-Foundry, streaming) or a folder of its '
                        'splits: the same as `foundrymix adopt INPUT` (see `foundrymix adopt -h`)')
    p.add_argument('--workers', type=int, default=0,
                   help='chunks tokenized at once, each on one core (default 0 = all cores); '
                        'threads of this process or worker processes, see --parallel; the output '
                        'is the same for any value')
    p.add_argument('--parallel', choices=PARALLEL_MODES, default=None,
                   help='how the workers run: threads of this process, each tokenizing on one '
                        'core while the Rust tokenizer releases the GIL (default for pretrain and '
                        'prompt/response finetuning), or forked processes (default for chats and '
                        '--preprocess, whose Python work holds the GIL)')
    _output_options(p)
    p.add_argument('--engine', choices=ENGINES, default='local',
                   help='local: this machine (default); ray: tasks on a Ray cluster (pip install '
                        "'foundrymix[ray]'), each writing its own shards, merged at the end "
                        '(in a directory every node sees; with --out s3://, each task\'s shards are '
                        'uploaded when it is done: give --keep-local a shared directory on a '
                        'multi-node cluster)')
    p.add_argument('--ray-address', default=None,
                   help='with --engine ray: the cluster to join (e.g. ray://head:10001 or auto); '
                        'default: start a local Ray with --workers CPUs')
    p.add_argument('--ray-task-mb', type=float, default=None,
                   help='with --engine ray: input MB per task (default 64); each task ends its own '
                        'last row (pretrain tail, finetune packing), so larger tasks lose less')
    p.add_argument('--preprocess', metavar='MODULE:FUNCTION', default=None,
                   help='Python function run on every record first (module importable from the '
                        'current directory or installed): takes the record dict, returns a dict '
                        '(read as usual) or None to skip it (counted as dropped: preprocess_skipped)')
    p.add_argument('--holdout', metavar='F', default=None,
                   help='also write a held-out eval split: OUT/train and OUT/eval, two datasets '
                        '(streams {local: OUT, split: eval}). F: a fraction (2%% or 0.02) or a number '
                        'of records (500). A record is held out by the sha256 of its content alone, so '
                        'the split is the same for any --workers or input order and exact duplicates '
                        'land on the same side')
    p.add_argument('--no-progress', dest='progress', action='store_false',
                   help='no progress bar or summary table')


def _output_options(p: argparse.ArgumentParser, text: str = '') -> None:
    """What ``convert`` and ``adopt`` (for its ``text`` sources) share: the output and its records."""
    p.add_argument('--overwrite', action='store_true',
                   help='replace the foundrymix dataset in --out: only what foundrymix wrote is '
                        'removed, and a folder holding anything else is refused before any work '
                        '(docs/safety.md)')
    p.add_argument('--on-error', choices=ON_ERROR, default='raise',
                   help=f'{text}bad records: stop with an error naming file, line and field (raise), or '
                        'skip them and count each by reason in the manifest (skip)')
    p.add_argument('--bos', action=argparse.BooleanOptionalAction, default=None,
                   help=f'{text}BOS before each document/example (default: iff the tokenizer adds BOS)')
    p.add_argument('--eos', action=argparse.BooleanOptionalAction, default=True,
                   help=f'{text}EOS after each document/example (default: on)')
    p.add_argument('--compression', default=None, help='MDS shard compression of the output, e.g. zstd')
    p.add_argument('--size-limit', default='64mb', help='MDS shard size limit (default 64mb)')
    p.add_argument('--hash', action='append', default=[], metavar='ALGO',
                   help='also write this shard hash to index.json (repeatable; e.g. sha1, sha256, '
                        'xxh64); xxh3_64 is always written. Read back with streaming\'s validate_hash')


def _options(cls: type, args: argparse.Namespace) -> Any:
    values = {k: getattr(args, k) for k in cls.__dataclass_fields__ if hasattr(args, k)}
    for k in ('max_seq_len', 'tokenizer'):  # not given: the options' defaults (2048, the bundled demo tokenizer)
        if values.get(k) is None:
            values.pop(k, None)
    for k in ('text_template', 'prompt_template', 'response_template'):
        if values.get(k) is not None:  # \n, \t, \\ as the characters (shells pass them literally)
            values[k] = re.sub(r'\\([nt\\])', lambda m: {'n': '\n', 't': '\t', '\\': '\\'}[m.group(1)], values[k])
    values['hash'] = tuple(values.get('hash', ()))
    if getattr(args, 'ray_task_mb', None) is not None:
        values['ray_task_bytes'] = max(1, int(args.ray_task_mb * (1 << 20)))
    return cls(**values)


@contextlib.contextmanager
def _lean() -> Iterator[None]:
    """A standalone ``foundrymix convert|adopt`` process keeps transformers from importing torch
    (explicit settings win) and skips the collector at exit; in-process callers see no change."""
    standalone = (sys.argv[1:2] in (['convert'], ['adopt']) and 'torch' not in sys.modules
                  and 'transformers' not in sys.modules)
    if standalone:
        for var in ('USE_TORCH', 'USE_TF', 'USE_FLAX'):
            os.environ.setdefault(var, '0')
        # silence "None of PyTorch, TensorFlow >= 2.0, or Flax have been found"
        os.environ.setdefault('TRANSFORMERS_NO_ADVISORY_WARNINGS', '1')
    yield
    if standalone:
        gc.freeze()


def _out(args: argparse.Namespace) -> Any:
    """``--out`` alone, or the (local, remote) pair of ``--keep-local DIR --out s3://...``."""
    if args.keep_local is None:
        return args.out
    if not is_url(args.out):
        raise UserError(f'--keep-local {args.keep_local}: only with --out s3://bucket/prefix '
                         f'(--out {args.out} is already local)')
    return (args.keep_local, args.out)


#: ``convert`` options ``--from-mds`` passes on to adopt; any other given is refused
_ADOPT_OPTIONS = ('inputs', 'out', 'tokenizer', 'max_seq_len', 'from_mds', 'split', 'workers', 'overwrite',
                  'on_error', 'bos', 'eos', 'compression', 'size_limit', 'hash', 'progress', 'chat_loss', 'func',
                  'command', 'convert_kind', 'parser')


def _from_mds(args: argparse.Namespace) -> int:
    """``convert KIND INPUT --from-mds ...``: ``adopt INPUT ...`` with the same options."""
    if len(args.inputs) != 1:
        raise UserError(f'--from-mds: give one MDS folder (or folder of splits), got {len(args.inputs)} inputs')
    for key, value in vars(args).items():
        if key not in _ADOPT_OPTIONS and value != args.parser.get_default(key):
            raise UserError(f"--{key.replace('_', '-')}: not used with --from-mds (the MDS columns are read "
                            f"as they are; see `foundrymix adopt -h`); leave it out")
    args.source, args.split = args.inputs[0], [args.split] if args.split else None
    args.chat_loss = getattr(args, 'chat_loss', 'all')
    return _run_adopt(args, command=args.convert_kind)


def _run(convert: Any, options_cls: type, args: argparse.Namespace) -> int:
    if args.from_mds:
        return _from_mds(args)
    with _lean():
        convert(args.inputs, _out(args), _options(options_cls, args))
    return 0


def _run_adopt(args: argparse.Namespace, command: Optional[str] = None) -> int:
    from foundrymix.convert.adopt import AdoptArgs, adopt
    common = {k: getattr(args, k) for k in ('workers', 'overwrite', 'on_error', 'bos', 'eos',
                                            'compression', 'size_limit')}
    common['hash'] = tuple(args.hash)
    with _lean():
        adopt(AdoptArgs(source=args.source, out=args.out, splits=tuple(args.split or ()),
                        tokenizer=args.tokenizer, max_seq_len=args.max_seq_len, chat_loss=args.chat_loss,
                        common=common, command=command),
              progress=args.progress)
    return 0


def _register_adopt(subparsers: Any) -> None:
    a = subparsers.add_parser(
        'adopt', help='existing MDS (LLM-Foundry, streaming) -> foundrymix datasets, no re-tokenizing',
        description='Read MDS shards written by other tools and write foundrymix datasets: '
                    'LLM-Foundry token shards (tokens: ndarray:int32) are re-cut from their ids with '
                    'no tokenizer run (documents end at the EOS ids in the data); finetune shards '
                    '(prompt/response) and raw-text MDS (text) are tokenized as by `convert`. A folder '
                    'of splits (<src>/train, <src>/val) gives <out>/train, <out>/val.')
    a.add_argument('source', metavar='DIR', help='an MDS folder (index.json), or a folder of them (splits); '
                                                 'or s3://bucket/prefix (copied to $TMPDIR first)')
    a.add_argument('-o', '--out', required=True,
                   help='output folder (empty or absent; a foundrymix dataset with --overwrite) or '
                        's3://bucket/prefix, as for `convert`; one subfolder per split when the source '
                        'has splits')
    a.add_argument('--split', action='append', metavar='NAME',
                   help='adopt only this split (repeatable; default: every split found)')
    a.add_argument('--tokenizer', default=None,
                   help='the tokenizer the shards were made with, required: LLM-Foundry\'s shards do '
                        'not record it (token shards: only its ids, EOS/BOS and size are used; text: '
                        'it tokenizes)')
    a.add_argument('--max-seq-len', type=int, default=None,
                   help='tokens per row (default: the length of the source rows for token shards, else 2048)')
    a.add_argument('--chat-loss', choices=CHAT_LOSS, default='all',
                   help="turns (tokenized Foundry finetune shards): loss on every turn's labels "
                        "(all, default) or only the last turn's (last: LLM-Foundry's default "
                        "target_responses)")
    a.add_argument('--workers', type=int, default=0, help='shards read at once (default 0 = all cores)')
    _output_options(a, 'text sources: ')
    a.add_argument('--no-progress', dest='progress', action='store_false', help='no progress bar or summary')
    a.set_defaults(func=_run_adopt)


def register(subparsers: Any) -> None:
    _register_adopt(subparsers)
    convert = subparsers.add_parser('convert', help='convert corpora to foundrymix MDS shards')
    sub = convert.add_subparsers(dest='convert_kind', required=True, metavar='KIND')

    p = sub.add_parser('pretrain', help='documents -> rows of exactly --max-seq-len tokens',
                       description='Tokenize documents, join them with [BOS] doc [EOS], cut rows of '
                                   'exactly --max-seq-len tokens (the tail is counted in the manifest).')
    _common(p)
    p.add_argument('--text-field', default='text', help='JSON/column field with the text (default text)')
    p.add_argument('--text', dest='text_template', metavar='TEMPLATE', default=None,
                   help=r"build the text from fields instead, e.g. '{title}\n\n{body}' "
                        r"(\n, \t, \\ are escapes; see --prompt in 'convert finetune -h' for the field syntax)")
    p.set_defaults(func=functools.partial(_run, convert_pretrain, PretrainOptions), parser=p)

    f = sub.add_parser('finetune', help='prompt/response or chat examples -> packed rows with loss masks',
                       description='Decoder-only examples [BOS] prompt response [EOS], loss on the '
                                   'response; packed first-fit into full rows (or padded).')
    _common(f)
    f.add_argument('--prompt-field', default='prompt')
    f.add_argument('--response-field', default='response', help="(a 'completion' field is accepted too)")
    f.add_argument('--prompt', dest='prompt_template', metavar='TEMPLATE', default=None,
                   help="build the prompt from fields, e.g. '{context}'. Fields: {name}, {name.key} "
                        "(dict key), {name[0]} (list index), {name[other]} (index or key = the value "
                        "of field other, e.g. {endings[label]}); {{ }} are literal braces")
    f.add_argument('--response', dest='response_template', metavar='TEMPLATE', default=None,
                   help="build the response from fields, e.g. ' {continuation}'")
    f.add_argument('--messages-field', default='messages', help='chat field: list of {role, content}')
    f.add_argument('--too-long', choices=TOO_LONG, default='drop',
                   help='examples longer than --max-seq-len: drop (default) or truncate')
    f.add_argument('--loss-on-prompt', action='store_true', help='loss on prompt tokens too')
    f.add_argument('--chat-loss', choices=CHAT_LOSS, default='all',
                   help='chats: loss on every assistant turn (all) or only the last')
    f.add_argument('--no-pack', dest='pack', action='store_false',
                   help='one example per row, padded (default: first-fit packing)')
    f.add_argument('--pack-window', type=int, default=64, help='open rows kept while packing (default 64)')
    f.set_defaults(func=functools.partial(_run, convert_finetune, FinetuneOptions), parser=f)

"""Options and set-up shared by the converters: everything that can fail cheaply is checked
before any work, so a mistake costs nothing and touches nothing."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from foundrymix.convert.mapping import load_preprocess
from foundrymix.convert.pipeline import PARALLEL_MODES, default_workers
from foundrymix.convert.paths import OutSpec, Output, check_overlap, discover_inputs, split_out
from foundrymix.convert.output import check_output_dir
from foundrymix.convert.upload import check_remote
from foundrymix.convert.writer import DEFAULT_HASH, check_shard_options
from foundrymix.errors import UserError
from foundrymix.heap import collector_paused
from foundrymix.format.schema import TokenizerInfo, token_dtype_for
from foundrymix.tokenizer import DEMO_TOKENIZER, describe_tokenizer, load_tokenizer, tokenizer_info

ON_ERROR = ('raise', 'skip')
#: the longest row: ``loss_spans`` and ``doc_lens`` are int32 (format/schema.py)
MAX_SEQ_LEN = (1 << 31) - 1
#: the most workers (more only cost memory)
MAX_WORKERS = 4096
ENGINES = ('local', 'ray')


@dataclass
class ConvertOptions:
    """Options every conversion takes. ``bos=None`` follows the tokenizer; ``workers``,
    ``parallel`` and ``chunk_bytes`` never change the output; ``hash``: besides ``xxh3_64``."""

    tokenizer: str = DEMO_TOKENIZER
    max_seq_len: int = 2048
    workers: int = 0
    overwrite: bool = False
    on_error: str = field(default='raise', metadata={'choices': ON_ERROR})  # metadata: checked by prepare()
    bos: Optional[bool] = None
    eos: bool = True
    compression: Optional[str] = None
    size_limit: str = '64mb'
    chunk_bytes: int = field(default=1 << 20, metadata={'positive': True})
    parallel: Optional[str] = field(default=None, metadata={'choices': PARALLEL_MODES})
    progress: bool = False
    hash: tuple[str, ...] = ()
    engine: str = field(default='local', metadata={'choices': ENGINES})
    ray_address: Optional[str] = None
    #: input per Ray task: large enough that its fixed cost stays small against tokenizing
    ray_task_bytes: int = field(default=64 << 20, metadata={'positive': True})
    preprocess: Optional[str] = None  # module:function run on every record first (mapping.py)
    from_mds: bool = False  # inputs are MDS dataset folders (foundrymix adopt, readers.py)
    split: Optional[str] = None  # the split of a saved DatasetDict input (paths.py)
    #: ``--holdout`` as given ('2%', '0.02', '500'): write OUT/eval and OUT/train (driver.py);
    #: each run's side is a :class:`~foundrymix.convert.driver.Holdout` (its manifest records it)
    holdout: Any = None

    @property
    def hash_algorithms(self) -> list[str]:
        """The default and ``hash``, sorted and unique (as ``MDSWriter`` requires)."""
        return sorted({DEFAULT_HASH, *(self.hash or ())})

    def to_manifest(self) -> dict[str, Any]:
        """The options as recorded in the manifest (run-time knobs left out)."""
        d = asdict(self)
        for knob in ('workers', 'parallel', 'overwrite', 'progress', 'chunk_bytes', 'hash', 'engine',
                     'ray_address', 'ray_task_bytes', 'from_mds'):
            d.pop(knob)
        d['hashes'] = self.hash_algorithms
        if d['holdout'] is None:  # recorded only for a side of a held-out split
            d.pop('holdout')
        return d


@dataclass(frozen=True)
class Setup:
    """What a conversion resolved before starting: inputs, tokenizer and separators."""

    inputs: list[str]
    tokenizer: Any
    info: TokenizerInfo
    token_dtype: str
    bos_id: Optional[int]
    eos_id: Optional[int]
    workers: int
    output: Output = Output(local=None, remote=None)
    remote: Any = None  # the checked S3 prefix (foundrymix.convert.upload.S3Target), if any


def prepare(inputs: list[str], out: OutSpec, options: ConvertOptions, min_content: int = 1,
            load: bool = True) -> Setup:
    """Validate ``options``, resolve inputs and load the tokenizer (fails fast, no output).
    ``min_content``: tokens a row must have room for; ``load=False``: describe the tokenizer only."""
    for f in fields(options):  # the rules in the fields' metadata, the converter's own options' too
        value, choices = getattr(options, f.name), f.metadata.get('choices')
        if choices and value is not None and value not in choices:
            raise UserError(f"--{f.name.replace('_', '-')} must be one of {', '.join(choices)}, got {value!r}")
        if f.metadata.get('positive') and value <= 0:
            raise UserError(f'{f.name} must be positive, got {value}')
    if not 0 <= options.workers <= MAX_WORKERS:
        raise UserError(f'--workers must be 0 (all cores) to {MAX_WORKERS:,}, got {options.workers}')
    if options.max_seq_len > MAX_SEQ_LEN:
        raise UserError(f'--max-seq-len {options.max_seq_len} is too large: rows store token positions '
                         f'as int32, so at most {MAX_SEQ_LEN:,}')
    if options.preprocess is not None:
        load_preprocess(options.preprocess)  # fails fast, naming the function
    output = split_out(out)
    local = output.local
    if local is not None:
        check_overlap(inputs, [], local)  # before discovery: an input equal to --out is named as such
    if options.from_mds:  # MDS folders found by adopt, which discovery never reads as inputs
        resolved = [os.path.abspath(p) for p in inputs]
    else:
        resolved = discover_inputs(inputs, exclude=os.path.realpath(local) if local is not None else None,
                                   split=options.split)
    if local is not None:
        check_overlap([], resolved, local)
        check_output_dir(os.path.abspath(local), options.overwrite)
    check_shard_options(options.hash_algorithms, options.compression)
    # reaches the endpoint: after the free checks, before any work
    remote = None if output.remote is None else check_remote(output.remote, options.overwrite)
    with collector_paused():  # importing makes it run over and over, finding nothing
        tok = load_tokenizer(options.tokenizer) if load else None
        info = tokenizer_info(tok) if load else describe_tokenizer(options.tokenizer)
    use_bos = info.add_bos if options.bos is None else options.bos
    if use_bos and info.bos_id is None:
        raise UserError(f'--bos: tokenizer {info.name!r} has no BOS token')
    bos_id = info.bos_id if use_bos else None
    eos_id = info.eos_id if options.eos else None
    n_special = (bos_id is not None) + (eos_id is not None)
    if options.max_seq_len < n_special + min_content:
        raise UserError(
            f'--max-seq-len {options.max_seq_len} is too small: each sequence needs {n_special} '
            f'special token(s) (BOS/EOS) and at least {min_content} more')
    return Setup(inputs=resolved, tokenizer=tok, info=info, token_dtype=token_dtype_for(info.vocab_size),
                 bos_id=bos_id, eos_id=eos_id, workers=options.workers or default_workers(),
                 output=output, remote=remote)


@dataclass
class WorkerState:
    """What an encode step needs, set up once per worker (thread pool or process)."""

    options: Any  # the converter's ConvertOptions subclass
    bos_id: Optional[int]
    eos_id: Optional[int]
    token_dtype: str

    @property
    def tok(self) -> Any:
        """The tokenizer, loaded on first use (cached per process by ``load_tokenizer``):
        encode steps that only check ids (adopt's) never import transformers."""
        return load_tokenizer(self.options.tokenizer)

    @property
    def vocab_size(self) -> int:
        return describe_tokenizer(self.options.tokenizer).vocab_size


_state: Optional[WorkerState] = None


def init_worker(options: ConvertOptions, bos_id: Optional[int], eos_id: Optional[int],
                token_dtype: str) -> None:
    """Set up this worker (in the calling process for thread workers)."""
    global _state
    _state = WorkerState(options=options, bos_id=bos_id, eos_id=eos_id, token_dtype=token_dtype)


def worker_state() -> WorkerState:
    assert _state is not None, 'init_worker was not called in this worker'
    return _state

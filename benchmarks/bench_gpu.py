"""Training throughput on a GPU: tokens/s per GPU, MFU and the loader's share of the step.

Llamas of :data:`MODELS` (125M: hidden 768, 12 layers; 1.3B: LLM-Foundry's MPT-1B shape;
``attention: document``, ``amp_bf16``, ``max_seq_len 2048``) trained through
``foundrymix.train.builder.build_trainer`` on the mixed loader: two pretrain streams of synthetic
MDS rows (``tests/mix_helpers.build_stream``: two documents each) and one finetune stream packed
by the real converter (``convert_finetune``, as ``foundrymix convert finetune`` packs it) from the
bundled Dolly sample (``data/samples``), repeated until it outlasts the run. One trainer
per row ``MODEL/ATTENTION/COMPILE/LOSS/FSDP/MICROBATCH[/pin|nopin]`` (the last: the loader's
``pin_memory``, default the loader's own), each in its own process on a GPU; a row that
cannot run here (FSDP without CUDA, flash-attn not installed) is reported as skipped with
the reason, one that fails with its error. One process, one GPU (``FULL_SHARD`` on one GPU
shards nothing but runs FSDP's wrapping, mixed precision and collectives): the numbers are
per GPU.

    .venv/bin/python benchmarks/bench_gpu.py [--rows ROW,...] [--steps 20] [--warmup 5] [--json out.json]
    .venv/bin/python benchmarks/bench_gpu.py --device cpu --tiny     # CI: a tiny model, seconds

Measured per step after ``--warmup`` steps, by a callback appended to the trainer:

* step time: from one ``before_dataloader`` to the next (on CUDA the callback synchronizes
  at ``batch_end``, so the GPU's work is inside its step and the loader wait is an upper
  bound: no overlap of the next batch's loading with GPU work is credited);
* loader wait: ``before_dataloader`` -> ``after_dataloader``: Composer's ``next()`` on the
  DataLoader, its bookkeeping and the ``after_dataloader`` callbacks before this one (Composer
  copies each microbatch to the device later, in the step); loader share = sum(wait) /
  sum(step), goal < 0.5 %. The time inside the DataLoader iterator's ``__next__`` (``next ms``:
  workers' batches handed over, by the pin thread with ``pin_memory``) is shown apart, and so is
  foundrymix's per-stream count (``count ms``, ``StreamAccounting.after_train_batch``: in the
  step while the GPU works, not in the wait);
* tokens/s per GPU: positions computed (device batch x ``max_seq_len``) / step time, and
  the real (non-pad) tokens / step time;
* MFU: ``(6 N + 12 L d S) * positions/s / peak`` (LLM-Foundry's formula, N = the
  non-embedding parameters plus the output layer, L layers, d hidden, S sequence), and MFU per
  real token: the same over real (non-pad) tokens/s; peak bf16 dense FLOP/s from the device
  name (H100/H200 989e12, A100 312e12) or ``--peak-flops``. Document attention computes less
  than the dense ``12 L d S`` term, so this MFU is an upper bound on what the attention part
  achieves;
* each row is run ``--repeats`` times (3 on a GPU): the run of median positions/s is reported,
  with every run's positions/s and the spread (max - min) / median.

Composer's ``speed_monitor`` logs similar throughput numbers; this script computes its own so
that the loader share and the configurations come out in one table (and as JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from unittest import mock
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

import torch
from composer.core import Callback, State
from composer.loggers import Logger

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'tests'))

from mix_helpers import build_stream  # noqa: E402

#: the model sizes of the table: transformers Llama configs (vocab 32,000 as the demo tokenizer's
#: family; ``1.3b`` has the shape of LLM-Foundry's MPT-1B row: d 2048, 24 layers, 16 heads)
MODELS = {
    'tiny': {'type': 'llama', 'hidden_size': 32, 'intermediate_size': 64, 'num_hidden_layers': 2,
             'num_attention_heads': 2, 'num_key_value_heads': 2, 'vocab_size': 8192, 'max_position_embeddings': 64},
    '125m': {'type': 'llama', 'hidden_size': 768, 'intermediate_size': 2048, 'num_hidden_layers': 12,
             'num_attention_heads': 12, 'num_key_value_heads': 12, 'vocab_size': 32000,
             'max_position_embeddings': 2048},
    '1.3b': {'type': 'llama', 'hidden_size': 2048, 'intermediate_size': 5504, 'num_hidden_layers': 24,
             'num_attention_heads': 16, 'num_key_value_heads': 16, 'vocab_size': 32000,
             'max_position_embeddings': 2048},
    # a 3B-class Llama (OpenLLaMA-3B's shape): needs FSDP's activation checkpointing on one GPU
    '3b': {'type': 'llama', 'hidden_size': 3200, 'intermediate_size': 8640, 'num_hidden_layers': 26,
           'num_attention_heads': 32, 'num_key_value_heads': 32, 'vocab_size': 32000,
           'max_position_embeddings': 2048},
}
#: FSDP fields beyond Composer's FSDP1 sharding strategies: FSDP2 (``fully_shard``), with activation checkpointing
FSDP2 = {'FSDP2': {'version': 2}, 'FSDP2-AC': {'version': 2, 'activation_checkpointing': True}}
PEAK_BF16 = {'H100': 989e12, 'H200': 989e12, 'A100': 312e12}
ATTN = {'sdpa': 'sdpa', 'flex': 'flex_attention', 'flash': 'flash_attention_2'}
#: one row each: MODEL/ATTENTION/COMPILE/LOSS/FSDP/MICROBATCH (the device batch is one microbatch)
GPU_ROWS = ['125m/flex/compile/fused/none/64', '1.3b/flex/compile/fused/none/8', '1.3b/flex/compile/fused/none/8/fp8',
            '3b/flex/compile/fused/FSDP2-AC/8']
TINY_ROWS = ['tiny/sdpa/eager/full/none/4', 'tiny/flex/eager/fused/none/4', 'tiny/sdpa/eager/full/FULL_SHARD/4',
             'tiny/flash/eager/full/none/4', 'tiny/sdpa/eager/full/none/4/fp8']


@dataclass(frozen=True)
class Row:
    """One configuration of the table."""

    model: str
    attn: str
    compile: bool
    fused: bool
    fsdp: Optional[str]
    batch: int
    pin: Optional[bool] = None  # train_loader.pin_memory; None: the loader's default
    fp8: bool = False  # precision: amp_fp8 (torchao's float8 linears)

    @classmethod
    def parse(cls, text: str) -> 'Row':
        try:
            model, attn, comp, loss, fsdp, batch, *tail = text.split('/')
            assert model in MODELS and attn in ATTN and comp in ('eager', 'compile') and loss in ('full', 'fused')
            pin = [t for t in tail if t in ('pin', 'nopin')]
            assert len(pin) <= 1 and len(set(tail)) == len(tail) and set(tail) <= {'pin', 'nopin', 'fp8'}
            return cls(model, attn, comp == 'compile', loss == 'fused', None if fsdp == 'none' else fsdp, int(batch),
                       pin[0] == 'pin' if pin else None, 'fp8' in tail)
        except (ValueError, AssertionError):
            raise SystemExit(f'bench_gpu: row {text!r}: write MODEL/ATTENTION/COMPILE/LOSS/FSDP/MICROBATCH[/PIN] with '
                             f'MODEL in {sorted(MODELS)}, ATTENTION in {sorted(ATTN)}, COMPILE eager|compile, '
                             f'LOSS full|fused, FSDP none|FULL_SHARD|...|FSDP2|FSDP2-AC, then /pin or /nopin (default: '
                             f'the loader\'s) and /fp8 (amp_fp8), e.g. 125m/flex/compile/fused/none/16/fp8') from None

    def __str__(self) -> str:
        return (f"{self.model}/{self.attn}/{'compile' if self.compile else 'eager'}/"
                f"{'fused' if self.fused else 'full'}/{self.fsdp or 'none'}/{self.batch}"
                f"{'' if self.pin is None else '/pin' if self.pin else '/nopin'}{'/fp8' if self.fp8 else ''}")


@contextlib.contextmanager
def timing(owner: Any, name: str, into: list[float]):
    """Append the wall time of every call of ``owner.name`` to ``into`` while inside."""
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    setattr(owner, name, timed)
    try:
        yield
    finally:
        if isinstance(owner, type):
            setattr(owner, name, original)
        else:
            delattr(owner, name)


class StepTimer(Callback):
    """Wall time of each step and of its wait on the loader (see the module docstring)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.steps: list[float] = []
        self.waits: list[float] = []
        self.real_tokens: list[int] = []
        self._before: Optional[float] = None
        self.batch_bytes = 0
        self.in_wait = False

    def before_dataloader(self, state: State, logger: Logger) -> None:
        now = time.perf_counter()
        if self._before is not None:
            self.steps.append(now - self._before)
        self._before = now
        self.in_wait = True

    def after_dataloader(self, state: State, logger: Logger) -> None:
        self.waits.append(time.perf_counter() - self._before)
        self.in_wait = False
        self.real_tokens.append(int(state.batch['attention_mask'].sum()))
        if not self.batch_bytes:
            self.batch_bytes = sum(t.numel() * t.element_size() for t in state.batch.values()
                                   if isinstance(t, torch.Tensor))
            print('bench_gpu: batch', {k: (tuple(t.shape), str(t.dtype), t.device.type) for k, t in
                                       state.batch.items() if isinstance(t, torch.Tensor)}, file=sys.stderr)

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def fit_end(self, state: State, logger: Logger) -> None:
        if self._before is not None:  # the last step ends here (no next before_dataloader)
            self.steps.append(time.perf_counter() - self._before)
            self._before = None


@dataclass
class Result:
    row: str                              # MODEL/ATTENTION/COMPILE/LOSS/FSDP/MICROBATCH
    model: str = ''
    params: int = 0                       # N of the MFU formula
    attn: str = ''
    compile: bool = False
    loss: str = 'full'
    fsdp: str = 'none'
    batch: int = 0                        # device batch = microbatch
    pin: Optional[bool] = None            # pin_memory of the DataLoaders that were read
    precision: str = ''
    status: str = 'ok'                    # ok | skipped: <why> | error: <what>
    steps: int = 0
    step_s: float = 0.0                   # median step time
    positions_per_s: float = 0.0          # per GPU
    real_tokens_per_s: float = 0.0        # per GPU
    mfu: Optional[float] = None
    mfu_real: Optional[float] = None      # the same formula per real (non-pad) token
    device: str = ''                      # the GPU's name, or cpu
    runs_positions_per_s: list = field(default_factory=list)  # every repeat's positions/s
    spread: float = 0.0                   # (max - min) / median of those
    peak_mem_gb: Optional[float] = None   # torch.cuda.max_memory_allocated
    graphs: Optional[int] = None          # graphs dynamo compiled (compile rows)
    recompiles: Optional[int] = None
    loader_share: float = 0.0             # sum(wait) / sum(step), measured steps
    loader_wait_ms: float = 0.0           # median
    next_ms: float = 0.0                  # median time inside the DataLoader iterator's __next__
    next_max_ms: float = 0.0              # the slowest __next__ of the measured steps
    count_ms: float = 0.0                 # median StreamAccounting.after_train_batch
    attention: str = 'document'
    wait_max_ms: float = 0.0
    #: per measured step (JSON only): loader wait, time in __next__, in StreamAccounting.after_train_batch
    waits_ms: list = field(default_factory=list)
    nexts_ms: list = field(default_factory=list)
    counts_ms: list = field(default_factory=list)
    batch_bytes: int = 0                  # one device batch's tensors
    #: Python's garbage collections in the measured steps: (generation, ms, inside the loader wait)
    gc_pauses: list = field(default_factory=list)
    batches: int = 0                      # all, warmup included
    real_tokens: int = 0                  # all batches, from their attention masks
    accounting_tokens: int = 0            # StreamAccounting's count of the same batches
    stream_samples: dict = field(default_factory=dict)  # StreamAccounting's rows per stream


SAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data', 'samples')


def build_streams(root: str, seq: int, rows: int) -> dict[str, str]:
    """Two synthetic pretrain streams (4 : 2 rows) and the converted finetune stream (>= 1 share)."""
    dirs = {}
    for tag, (name, share) in enumerate((('web', 4), ('code', 2))):
        dirs[name] = os.path.join(root, name)
        build_stream(dirs[name], 'pretrain', rows * share, tag, max_seq_len=seq, size_limit=1 << 24)
    dirs['chat'] = os.path.join(root, 'chat')
    convert_chat(dirs['chat'], seq, rows)
    return dirs


def convert_chat(out: str, seq: int, rows: int) -> None:
    """The finetune stream as ``convert finetune`` packs it: the bundled Dolly sample (1,000 examples),
    repeated until it packs into at least ``rows`` rows of ``seq``."""
    import shutil

    from foundrymix.convert.finetune import FinetuneOptions, convert_finetune

    with open(os.path.join(SAMPLES, 'dolly_hhrlhf_sample.jsonl'), encoding='utf-8') as f:
        examples = f.read()
    copies, src = 1, out + '.jsonl'
    while True:
        with open(src, 'w', encoding='utf-8') as f:
            f.write(examples * copies)
        got = convert_finetune([src], out, FinetuneOptions(max_seq_len=seq, workers=min(8, os.cpu_count() or 1),
                                                           size_limit='16mb')).counts
        if got.rows >= rows:
            print(f'bench_gpu: finetune stream: {got.rows} rows packed from {copies} x 1,000 Dolly examples, '
                  f'{got.pad_tokens / (got.rows * seq):.1%} padding', file=sys.stderr)
            return
        shutil.rmtree(out)
        copies = -(-rows * copies // max(got.rows, 1))


def flops_per_position(cfg: dict, seq: int) -> tuple[float, int]:
    """Training FLOPs per position, ``6 N + 12 L d S`` (LLM-Foundry's MFU formula), and N: the
    parameters less the input embedding (the output layer counted once, as Foundry counts MPT's
    tied one); grouped-query attention's smaller key/value projections included."""
    d, layers, inter = cfg['hidden_size'], cfg['num_hidden_layers'], cfg['intermediate_size']
    kv = d // cfg['num_attention_heads'] * cfg['num_key_value_heads']
    n = layers * (2 * d * d + 2 * d * kv + 3 * d * inter) + cfg['vocab_size'] * d
    return 6 * n + 12 * layers * d * seq, n


def peak_flops(override: Optional[float]) -> Optional[float]:
    if override:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def skip_reason(row: Row, device: str) -> Optional[str]:
    if row.fsdp and device != 'gpu':
        return 'skipped: FSDP needs CUDA'
    if row.fp8 and device != 'gpu':
        return 'skipped: amp_fp8 needs a GPU with FP8'
    if row.attn == 'flash':
        if device != 'gpu':
            return 'skipped: flash_attention_2 needs CUDA'
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            return 'skipped: flash-attn is not installed'
    return None


def run_one(args: argparse.Namespace, dirs: dict[str, str], row: Row, work: str) -> Result:
    from composer.utils import dist

    from foundrymix.train.builder import build_trainer
    from foundrymix.train.config import TrainConfig

    precision = ('amp_fp8' if row.fp8 else 'amp_bf16') if args.device == 'gpu' else 'fp32'
    result = Result(row=str(row), model=row.model, attn=row.attn, compile=row.compile,
                    loss='fused' if row.fused else 'full', fsdp=row.fsdp or 'none', batch=row.batch,
                    precision=precision, attention=args.attention,
                    device=torch.cuda.get_device_name() if args.device == 'gpu' else 'cpu')
    reason = skip_reason(row, args.device)
    if reason:
        result.status = reason
        return result
    model = dict(MODELS[row.model], attn_implementation=ATTN[row.attn], attention=args.attention)
    model['max_position_embeddings'] = max(model['max_position_embeddings'], args.seq)
    if row.fused:
        model['fused_loss'] = True
    name = str(row).replace('/', '-')
    top: dict[str, Any] = {
        'run_name': f'bench-{name}', 'seed': 1, 'max_seq_len': args.seq, 'model': model,
        'train_loader': {'streams': {n: {'local': d} for n, d in dirs.items()}, 'shuffle': True,
                         'num_workers': args.workers, **({} if row.pin is None else {'pin_memory': row.pin})},
        'global_train_batch_size': row.batch * dist.get_world_size(),
        'max_duration': f'{args.warmup + args.steps}ba', 'optimizer': {'lr': 1e-4},
        'device': args.device, 'precision': precision,
        'progress_bar': False, 'loggers': {}, 'save_interval': '100000ba',
        'callbacks': {'stream_accounting': {'out_dir': os.path.join(work, name), 'plot': False,
                                            'log_interval': '100000ba'}}}
    if row.fsdp:
        top['fsdp'] = FSDP2.get(row.fsdp, {'sharding_strategy': row.fsdp, 'mixed_precision': 'DEFAULT'})
    if row.compile:
        top['compile_config'] = {}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    run = build_trainer(TrainConfig.from_dict(top))
    timer = StepTimer(cuda=args.device == 'gpu')
    run.trainer.state.callbacks.append(timer)
    nexts: list[float] = []
    counts: list[float] = []
    pauses: list[tuple[int, float, bool]] = []
    gc_clock: dict[str, float] = {}

    def on_gc(phase: str, info: dict) -> None:  # the main process's collections, timed
        if phase == 'start':
            gc_clock['start'] = time.perf_counter()
        elif len(timer.steps) >= args.warmup and 'start' in gc_clock:
            pauses.append((info['generation'], (time.perf_counter() - gc_clock.pop('start')) * 1e3, timer.in_wait))

    gc.callbacks.append(on_gc)
    pinned: set[bool] = set()
    iter_of = torch.utils.data.DataLoader.__iter__

    def recorded_iter(loader: Any) -> Any:  # each span's DataLoader: its pin_memory, as it was given
        pinned.add(bool(loader.pin_memory))
        return iter_of(loader)

    try:
        with mock.patch.object(torch.utils.data.DataLoader, '__iter__', recorded_iter), \
                timing(torch.utils.data.dataloader._BaseDataLoaderIter, '__next__', nexts), \
                timing(run.accounting, 'after_train_batch', counts):
            run.trainer.fit()
    finally:
        gc.callbacks.remove(on_gc)
        run.trainer.close()
        run.claims.release()
    result.pin = pinned.pop() if len(pinned) == 1 else None
    if row.compile:
        from torch._dynamo.utils import counters  # dynamo's own tally (a benchmark may read it)
        result.graphs = int(counters['stats']['unique_graphs'])
        result.recompiles = int(sum(counters['recompiles'].values()))
    if torch.cuda.is_available():
        result.peak_mem_gb = torch.cuda.max_memory_allocated() / 2**30
    result.gc_pauses = [(g, round(ms, 3), w) for g, ms, w in pauses]
    steps, waits = timer.steps[args.warmup:], timer.waits[args.warmup:]
    if len(nexts) >= len(timer.waits):  # one __next__ per batch (0 if the loader is no torch DataLoader)
        measured = nexts[args.warmup:len(timer.waits)]
        result.next_ms, result.next_max_ms = statistics.median(measured) * 1e3, max(measured) * 1e3
    result.count_ms = statistics.median(counts[args.warmup:]) * 1e3
    result.wait_max_ms = max(waits) * 1e3
    result.waits_ms = [round(w * 1e3, 3) for w in waits]
    result.nexts_ms = [round(w * 1e3, 3) for w in nexts[args.warmup:len(timer.waits)]]
    result.counts_ms = [round(w * 1e3, 3) for w in counts[args.warmup:]]
    result.batch_bytes = timer.batch_bytes
    real = timer.real_tokens[args.warmup:]
    result.steps = len(steps)
    result.step_s = statistics.median(steps)
    result.positions_per_s = row.batch * args.seq * len(steps) / sum(steps)
    result.real_tokens_per_s = sum(real) / sum(steps)
    result.loader_share = sum(waits) / sum(steps)
    result.loader_wait_ms = statistics.median(waits) * 1e3
    per_position, result.params = flops_per_position(MODELS[row.model], args.seq)
    peak = peak_flops(args.peak_flops)
    if peak:
        result.mfu = per_position * result.positions_per_s / peak
        result.mfu_real = per_position * result.real_tokens_per_s / peak
    result.batches, result.real_tokens = len(timer.real_tokens), sum(timer.real_tokens)
    result.accounting_tokens = int(run.accounting.tokens.sum())
    result.stream_samples = {n: s['samples'] for n, s in run.accounting.streams().items()}
    return result


def run_row(args: argparse.Namespace, dirs: dict[str, str], row: Row, work: str) -> Result:
    """``row`` measured ``--repeats`` times: the run of median positions/s, every run's figure and
    their spread."""
    runs = [run_once(args, dirs, row, work) for _ in range(args.repeats)]
    ok = sorted((r for r in runs if r.status == 'ok'), key=lambda r: r.positions_per_s)
    if not ok:
        return runs[0]
    best = ok[(len(ok) - 1) // 2]
    best.runs_positions_per_s = [round(r.positions_per_s, 1) for r in runs if r.status == 'ok']
    figures = best.runs_positions_per_s
    best.spread = (max(figures) - min(figures)) / statistics.median(figures)
    return best


def run_once(args: argparse.Namespace, dirs: dict[str, str], row: Row, work: str) -> Result:
    """``row`` measured here, or (``--isolate``) in a fresh process: a compiled graph, an
    out-of-memory or a fragmented allocator must not carry over into the next row."""
    if not args.isolate:
        try:
            return run_one(args, dirs, row, work)
        except Exception as e:  # one configuration's failure must not hide the others' numbers
            traceback.print_exc()
            return Result(row=str(row), model=row.model, attn=row.attn, compile=row.compile,
                          loss='fused' if row.fused else 'full', fsdp=row.fsdp or 'none', batch=row.batch,
                          status=f'error: {type(e).__name__}: {str(e).splitlines()[0][:200]}')
    out = os.path.join(work, f'{str(row).replace("/", "-")}.json')
    cmd = [sys.executable, os.path.abspath(__file__), '--device', args.device, '--rows', str(row), '--no-isolate',
           '--repeats', '1',
           '--steps', str(args.steps), '--warmup', str(args.warmup), '--workers', str(args.workers),
           '--attention', args.attention, '--seq', str(args.seq), '--data', os.path.dirname(dirs['web']), '--json', out]
    if args.peak_flops:
        cmd += ['--peak-flops', str(args.peak_flops)]
    if args.tiny:
        cmd.append('--tiny')
    try:
        proc = subprocess.run(cmd, timeout=args.row_timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = 'timeout'
    if os.path.exists(out):
        with open(out, encoding='utf-8') as f:
            return Result(**json.load(f)['results'][0])
    return Result(row=str(row), model=row.model, attn=row.attn, compile=row.compile,
                  loss='fused' if row.fused else 'full', fsdp=row.fsdp or 'none', batch=row.batch,
                  status=f'error: the row\'s process ended ({code}) without a result')


def print_table(results: list[Result], device: str, args: argparse.Namespace) -> None:
    from composer.utils import dist
    print(f'bench_gpu: {device}, {dist.get_world_size()} rank(s), seq {args.seq}, {args.attention} attention, '
          f'{args.workers} workers, {args.steps} steps after '
          f'{args.warmup}, median of {args.repeats} run(s) per row; torch {torch.__version__}'
          f'{", CUDA " + str(torch.version.cuda) if torch.cuda.is_available() else ""}')
    print(f'{"device":<22} {"model":<6} {"N":>6} {"attn":<6} {"compile":<8} {"loss":<6} {"prec":<9} {"fsdp":<10} '
          f'{"micro":>5} {"pin":>3} {"pos/s/GPU":>10} {"real/s":>10} {"spread":>6} {"MFU":>6} {"MFUreal":>7} '
          f'{"mem GB":>6} {"step ms":>8} {"loader":>7} {"next ms":>7} {"max ms":>7} {"graphs":>6}  status')
    for r in results:
        mfu = f'{r.mfu:6.1%}' if r.mfu is not None else '     -'
        mfu_real = f'{r.mfu_real:7.1%}' if r.mfu_real is not None else '      -'
        mem = f'{r.peak_mem_gb:6.1f}' if r.peak_mem_gb is not None else '     -'
        graphs = f'{r.graphs}+{r.recompiles}' if r.graphs is not None else '-'
        pin = '-' if r.pin is None else 'yes' if r.pin else 'no'
        params = (f'{r.params / 1e6:.0f}M' if r.params >= 1e7 else f'{r.params / 1e6:.2f}M') if r.params else '-'
        print(f'{r.device[:22]:<22} {r.model:<6} {params:>6} {r.attn:<6} {"compile" if r.compile else "eager":<8} '
              f'{r.loss:<6} {r.precision:<9} {r.fsdp:<10} {r.batch:>5} {pin:>3} {r.positions_per_s:>10,.0f} '
              f'{r.real_tokens_per_s:>10,.0f} {r.spread:>6.1%} {mfu} {mfu_real} {mem} '
              f'{r.step_s * 1e3:>8.1f} {r.loader_share:>7.2%} {r.next_ms:>7.2f} {r.next_max_ms:>7.1f} '
              f'{graphs:>6}  {r.status}')


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--device', choices=('gpu', 'cpu'), default='gpu' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--tiny', action='store_true', help='the tiny model and 64-token rows (CI, CPU)')
    p.add_argument('--rows', default=None, help='comma-separated MODEL/ATTENTION/COMPILE/LOSS/FSDP/MICROBATCH '
                                                '(default: the GPU table; --tiny: the CI rows)')
    p.add_argument('--steps', type=int, default=None, help='measured steps (default 20; --tiny 4)')
    p.add_argument('--warmup', type=int, default=None, help='steps not measured (default 5; --tiny 1)')
    p.add_argument('--workers', type=int, default=None, help='DataLoader workers (default 4; --tiny 0)')
    p.add_argument('--attention', choices=('document', 'causal'), default='document',
                   help="the model's attention: document (block-diagonal per document, default) or causal")
    p.add_argument('--pin-memory', choices=('pin', 'nopin'), default=None,
                   help='train_loader.pin_memory in every row that does not set it (default: the loader\'s)')
    p.add_argument('--seq', type=int, default=None, help='max_seq_len (default 2048; --tiny 64)')
    p.add_argument('--repeats', type=int, default=None, help='runs per row, the median reported (default 3 on a '
                                                                 'GPU, 1 on the CPU)')
    p.add_argument('--peak-flops', type=float, default=None, help='peak bf16 FLOP/s of one GPU, for MFU')
    p.add_argument('--isolate', action=argparse.BooleanOptionalAction, default=None,
                   help='each row in its own process (default on a GPU)')
    p.add_argument('--row-timeout', type=float, default=None, help='seconds a row may take (isolated rows)')
    p.add_argument('--data', default=None, help=argparse.SUPPRESS)  # the streams, built by the parent
    p.add_argument('--json', default=None, help='also write the results here')
    args = p.parse_args(argv)
    if args.seq is None:
        args.seq = 64 if args.tiny else 2048
    for name, full, tiny in (('steps', 20, 4), ('warmup', 5, 1), ('workers', 4, 0)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    if args.isolate is None:
        args.isolate = args.device == 'gpu'
    if args.repeats is None:
        args.repeats = 3 if args.device == 'gpu' else 1
    rows = [Row.parse(r) for r in (args.rows.split(',') if args.rows else TINY_ROWS if args.tiny else GPU_ROWS)]
    if args.pin_memory:
        rows = [r if r.pin is not None else replace(r, pin=args.pin_memory == 'pin') for r in rows]
    most = max(r.batch for r in rows)
    n_rows = max(64, (args.warmup + args.steps) * most * 8)  # the streams outlast the run

    from composer.utils import dist
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix='bench-gpu-') as work:
        data = args.data or os.path.join(work, 'data')
        dirs = {n: os.path.join(data, n) for n in ('web', 'code', 'chat')}
        if args.data is None:
            dirs = build_streams(data, args.seq, n_rows // 7 + 1)
        device = torch.cuda.get_device_name() if args.device == 'gpu' else 'cpu'
        for row in rows:
            results.append(run_row(args, dirs, row, work))
            if args.isolate:  # the table so far, for a run cut short
                r = results[-1]
                print(f'bench_gpu: {row}: {r.status} {r.positions_per_s:,.0f} positions/s, {r.real_tokens_per_s:,.0f} '
                      f'real tokens/s, runs {r.runs_positions_per_s}', flush=True)
            if args.json and dist.get_global_rank() == 0:  # rewritten after each row: a run cut short keeps its rows
                with open(args.json, 'w', encoding='utf-8') as f:
                    json.dump({'device': device, 'world_size': dist.get_world_size(), 'seq': args.seq,
                               'torch': torch.__version__, 'cuda': torch.version.cuda,
                               'results': [asdict(r) for r in results]}, f, indent=2)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if dist.get_global_rank() != 0:
        return 0
    print_table(results, device, args)
    return 1 if any(r.status.startswith('error') for r in results) else 0


if __name__ == '__main__':
    sys.exit(main())

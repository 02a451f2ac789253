"""The exact plan of a mixture: rows, passes, shares and tokens per epoch; where a run ends.

Why exact: Megatron-style blending oversamples by 0.5% and users cannot tell which rows
repeat. Here every number comes from the code streaming itself runs:

* rows per epoch per stream from ``Stream.apply_weights`` (called exactly as
  ``StreamingDataset.__init__`` calls it: underlying rows from ``index.json``, the
  ``epoch_size`` and the shuffle seed, which breaks ``proportion`` rounding ties);
* when an epoch is not made of whole global batches, or the batching method drops rows
  (``stratified``), the epoch's sample order from streaming's own ``generate_work``
  (shuffle and partition included) on a stand-in dataset built from the index files, cut
  into DataLoader batches the way the DataLoader cuts them, so even ``drop_last`` losses
  are counted per stream.

Nothing here reads a shard. Token figures: every row is ``max_seq_len`` slots, so the
tokens Composer counts (``tok``) are rows x ``max_seq_len`` exactly. Real (non-padding)
and loss tokens per epoch are the manifest totals x passes: exact when every row is seen
equally often (whole passes) or rows are uniform (pretrain), otherwise an *expected*
value, because a fractional pass picks a random subset of rows (``exact`` says which).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
from streaming import StreamingDataset

from foundrymix.mix.config import ConfigError

if TYPE_CHECKING:
    from foundrymix.mix.mixer import StreamMixer

#: epochs' sample orders are generated for exact per-stream counts only up to this many samples
SIMULATE_LIMIT = 20_000_000

DURATION_UNITS = {'ep': 'epochs', 'ba': 'batches', 'sp': 'samples', 'tok': 'tokens'}


@dataclass
class StreamPlan:
    """One stream's share of every epoch."""

    name: str
    kind: str
    rows: int                  # underlying rows (index.json)
    rows_per_epoch: int        # rows streaming samples per epoch (Stream.apply_weights)
    passes: float              # rows_per_epoch / rows
    full_passes: int           # every row is seen at least this many times per epoch ...
    rows_seen_extra: int       # ... and this many rows once more (a fresh random subset each epoch)
    unseen_rows: int           # rows not seen at all in an epoch (passes < 1)
    share: float               # of the epoch's rows
    trained_rows_per_epoch: int  # rows in full batches of epoch 0 (drop_last / stratified cuts)
    slot_tokens_per_epoch: int   # rows_per_epoch x max_seq_len (what Composer's `tok` counts)
    tokens_per_epoch: float      # real (non-padding) tokens; exact iff tokens_exact
    loss_tokens_per_epoch: float
    tokens_exact: bool
    token_share: float = 0.0     # of the epoch's real tokens
    loss_token_share: float = 0.0


@dataclass
class DurationPlan:
    """Where ``max_duration`` ends, in Composer's terms."""

    max_duration: str
    unit: str
    value: int
    total_batches: int
    total_samples: int
    total_tokens: int          # slot tokens (Composer `tok`)
    epochs: float              # total_batches / batches_per_epoch
    full_epochs: int
    ends_mid_epoch: bool
    last_epoch: int            # 0-based index of the epoch the run stops in (or last finished)
    last_batch_in_epoch: int   # batches of that epoch trained (== batches_per_epoch if not mid)
    last_sample_in_epoch: int  # samples of that epoch trained
    rows_per_stream: Optional[dict[str, int]] = None  # exact rows trained per stream, whole run


@dataclass
class Plan:
    """The mixture per epoch and, given ``max_duration``, how long the run is."""

    streams: list[StreamPlan]
    epoch_size: int
    batch_size: int
    world_size: int
    global_batch_size: int
    batches_per_epoch: int
    samples_per_epoch: int     # samples in the full batches of an epoch (what is trained)
    max_seq_len: int
    batching_method: str
    shuffle_seed: int
    duration: Optional[DurationPlan] = None
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def stream(self, name: str) -> StreamPlan:
        return next(s for s in self.streams if s.name == name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ------------------------------------------------------------ rendering
    def render(self, console: Any = None) -> None:
        """Print the plan as rich tables (to ``console`` or stdout)."""
        from rich.console import Console
        from rich.table import Table

        if console is None:
            console = Console()
            if not console.is_terminal:
                console = Console(width=160)
        table = Table(title=f'Mixture per epoch ({self.epoch_size:,} rows of {self.max_seq_len} '
                            f'tokens; batching {self.batching_method}, seed {self.shuffle_seed})')
        for col in ('stream', 'kind', 'rows', 'rows/epoch', 'passes', 'seen', 'share',
                    'tokens/epoch', 'loss tok/epoch', 'tok share', 'loss share'):
            table.add_column(col, justify='left' if col in ('stream', 'kind', 'seen') else 'right')
        for s in self.streams:
            approx = '' if s.tokens_exact else '~'
            table.add_row(
                s.name, s.kind, f'{s.rows:,}', f'{s.rows_per_epoch:,}', f'{s.passes:.3g}x',
                seen_text(s), f'{s.share:.1%}', f'{approx}{s.tokens_per_epoch:,.0f}',
                f'{approx}{s.loss_tokens_per_epoch:,.0f}', f'{s.token_share:.1%}',
                f'{s.loss_token_share:.1%}')
        console.print(table)
        console.print(
            f'global batch {self.global_batch_size} ({self.batch_size} x {self.world_size} '
            f'ranks): {self.batches_per_epoch:,} batches = {self.samples_per_epoch:,} samples '
            f'per epoch')
        if self.duration:
            d = self.duration
            where = (f'stops in epoch {d.last_epoch} after batch {d.last_batch_in_epoch:,} '
                     f'(sample {d.last_sample_in_epoch:,} of the epoch)' if d.ends_mid_epoch
                     else f'ends exactly at the end of epoch {d.last_epoch}')
            console.print(f'max_duration {d.max_duration}: {d.total_batches:,} batches, '
                          f'{d.total_samples:,} samples, {d.total_tokens:,} tokens = '
                          f'{d.epochs:.4g} epochs ({d.full_epochs} full); {where}')
            if d.rows_per_stream is not None:
                console.print('rows trained per stream over the run: ' + ', '.join(
                    f'{k} {v:,}' for k, v in d.rows_per_stream.items()))
        for note in self.notes:
            console.print(f'note: {note}')
        for warning in self.warnings:
            console.print(f'[yellow]warning:[/yellow] {warning}')


def seen_text(s: StreamPlan) -> str:
    """'each row 2x or 3x' style description of how often rows are seen per epoch."""
    if s.rows_seen_extra == 0:
        return f'every row {s.full_passes}x'
    if s.full_passes == 0:
        return f'{s.rows_seen_extra:,} rows 1x, {s.unseen_rows:,} unseen'
    return (f'{s.rows - s.rows_seen_extra:,} rows {s.full_passes}x, '
            f'{s.rows_seen_extra:,} rows {s.full_passes + 1}x')


def parse_duration(text: Any) -> tuple[int, str]:
    """Parse a Composer time string (``100ba``, ``5000sp``, ``1000000tok``, ``3ep``)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text, 'ep'  # Composer reads a bare int as epochs
    m = re.fullmatch(r'\s*(\d+)\s*(ep|ba|sp|tok)\s*', str(text))
    if not m:
        raise ConfigError(f'max_duration: {text!r} is not a Composer time string with a whole '
                          f'number of ep, ba, sp or tok (e.g. 3ep, 100ba, 5000sp, 1000000tok)')
    value = int(m.group(1))
    if value <= 0:
        raise ConfigError(f'max_duration: must be positive, got {text!r}')
    return value, m.group(2)


class _PlanDataset:
    """The attributes streaming's ``generate_work`` reads, built from index files only.

    Lets the plan run streaming's own resampling, shuffling and partitioning code
    (``StreamingDataset.resample_streams`` is borrowed as-is) without constructing a
    dataset, which would register shared memory and scan cache directories.
    """

    resample_streams = StreamingDataset.resample_streams

    def __init__(self, mixer: 'StreamMixer', streams: list[Any], shard_rows: list[list[int]],
                 epoch_size: int, batch_size: int, num_nodes: int) -> None:
        c = mixer.config
        self.streams = streams
        self.num_streams = len(streams)
        self.epoch_size = epoch_size
        self.batch_size = batch_size
        self.shuffle = c.shuffle
        self.shuffle_seed = c.shuffle_seed
        self.shuffle_algo = c.shuffle_algo
        self.sampling_method = c.sampling_method
        self.sampling_granularity = c.sampling_granularity
        self.partition_algo = c.partition_algo
        self.epoch_seed_change = c.shuffle and c.sampling_method == 'balanced'
        self.initial_physical_nodes = None
        # As StreamingDataset._resume defaults them on a fresh start.
        if c.num_canonical_nodes:
            self.num_canonical_nodes = c.num_canonical_nodes
        elif c.shuffle_algo in ('py1s', 'py2s'):
            self.num_canonical_nodes = 64 * num_nodes
        else:
            self.num_canonical_nodes = num_nodes
        self.shuffle_block_size = c.shuffle_block_size if c.shuffle_block_size is not None else \
            max(4_000_000 // self.num_canonical_nodes, 1 << 18)
        self.shards_per_stream = np.array([len(r) for r in shard_rows], np.int64)
        self.shard_offset_per_stream = np.concatenate(
            ([0], np.cumsum(self.shards_per_stream)[:-1])).astype(np.int64)
        self.samples_per_shard = np.array([n for r in shard_rows for n in r], np.int64)
        self.sample_offset_per_shard = self.samples_per_shard.cumsum() - self.samples_per_shard
        rows = np.array([sum(r) for r in shard_rows], np.int64)
        self.sample_offset_per_stream = np.concatenate(([0], np.cumsum(rows)[:-1])).astype(np.int64)


def epoch_batches(ds: _PlanDataset, epoch: int, num_nodes: int, ranks_per_node: int,
                  num_workers: int, drop_last: bool) -> list[np.ndarray]:
    """The global batches of one epoch, in training order, as DataLoaders will yield them.

    Each rank's DataLoader takes its workers' sample streams (streaming's partition,
    ``-1`` padding skipped), cuts each into ``batch_size`` batches (dropping a short last
    one if ``drop_last``) and yields them worker by worker in turn; global batch ``k``
    is batch ``k`` of every rank.
    """
    from streaming.base.batching import generate_work
    from streaming.base.world import World

    workers = max(1, num_workers)
    world = World(num_nodes, ranks_per_node, workers, 0)
    work = generate_work(ds.batching_method, ds, world, epoch, 0)
    per_rank = []
    for node in range(num_nodes):
        for rank in range(ranks_per_node):
            worker_batches = []
            for w in range(workers):
                ids = work[node, rank, w].reshape(-1)
                ids = ids[ids != -1]
                n_full = len(ids) // ds.batch_size
                batches = [ids[i * ds.batch_size:(i + 1) * ds.batch_size] for i in range(n_full)]
                if not drop_last and len(ids) % ds.batch_size:
                    batches.append(ids[n_full * ds.batch_size:])
                worker_batches.append(batches)
            order = []
            for i in range(max((len(b) for b in worker_batches), default=0)):
                order += [b[i] for b in worker_batches if i < len(b)]
            per_rank.append(order)
    n = min(len(r) for r in per_rank)  # every rank must step together
    return [np.concatenate([r[k] for r in per_rank]) for k in range(n)]


def build_plan(mixer: 'StreamMixer', batch_size: int, max_duration: Optional[Any] = None,
               world_size: int = 1, num_nodes: int = 1) -> Plan:
    """Compute the :class:`Plan` of ``mixer``'s config for a per-rank ``batch_size``."""
    from streaming import Stream
    from streaming.base.util import number_abbrev_to_int

    if batch_size <= 0 or world_size <= 0 or world_size % num_nodes:
        raise ConfigError(f'batch_size ({batch_size}) and world_size ({world_size}) must be '
                          f'positive and world_size a multiple of num_nodes ({num_nodes})')
    mixer.validate()
    c = mixer.config
    names = mixer.stream_names
    manifests = mixer.manifests
    L = mixer.max_seq_len
    warnings: list[str] = []
    notes: list[str] = []

    shard_rows = [mixer.shard_rows(n) for n in names]
    rows = np.array([sum(r) for r in shard_rows], np.int64)
    for name, n in zip(names, rows):
        if manifests[name].counts.rows != n:
            warnings.append(f'{name}: manifest says {manifests[name].counts.rows:,} rows, '
                            f'index.json has {int(n):,}; the index (what streaming reads) is used')

    # Exactly as StreamingDataset.__init__: Stream objects, then apply_weights.
    streams = [Stream(remote=s.remote, local=c.stream_local(n), split=s.split, repeat=s.repeat,
                      proportion=s.proportion, choose=s.choose)
               for n, s in c.streams.items()]
    epoch_size_value = number_abbrev_to_int(c.epoch_size) if c.epoch_size else None
    epoch_size = Stream.apply_weights(streams, rows, epoch_size_value, c.shuffle_seed)

    G = batch_size * world_size
    ds = _PlanDataset(mixer, streams, shard_rows, epoch_size, batch_size, num_nodes)
    ds.batching_method = c.batching_method  # type: ignore[attr-defined]
    ranks_per_node = world_size // num_nodes

    def trained_counts(epoch: int, n_batches: Optional[int] = None) -> tuple[np.ndarray, int]:
        batches = epoch_batches(ds, epoch, num_nodes, ranks_per_node, c.num_workers, c.drop_last)
        if n_batches is not None:
            batches = batches[:n_batches]
        if not batches:
            return np.zeros(len(names), np.int64), 0
        ids = np.concatenate(batches)
        stream_ids = np.searchsorted(ds.sample_offset_per_stream, ids, side='right') - 1
        return np.bincount(stream_ids, minlength=len(names)).astype(np.int64), len(batches)

    chooses = np.array([int(s.choose) for s in streams], np.int64)
    whole_batches = epoch_size % G == 0 and c.batching_method == 'random'
    if whole_batches:
        per_epoch_counts, batches_per_epoch = chooses, epoch_size // G
    elif epoch_size <= SIMULATE_LIMIT:
        per_epoch_counts, batches_per_epoch = trained_counts(0)
    else:
        batches_per_epoch = epoch_size // G if c.drop_last else math.ceil(epoch_size / G)
        per_epoch_counts = chooses
        notes.append('epoch too large to generate its order: trained rows per stream are the '
                     'sampled rows (the drop_last tail is not subtracted per stream)')
    samples_per_epoch = int(per_epoch_counts.sum())
    if samples_per_epoch < epoch_size:
        why = ('stratified batching keeps only whole batches of the exact composition'
               if c.batching_method == 'stratified' else
               f'epoch size {epoch_size:,} is not a multiple of the global batch {G}'
               + (' (drop_last)' if c.drop_last else ''))
        warnings.append(f'{epoch_size - samples_per_epoch:,} of {epoch_size:,} sampled rows per '
                        f'epoch are never trained: {why}')
    elif samples_per_epoch > epoch_size:
        # streaming pads every rank's share to the same length with repeated rows, and on
        # some sizes those padded rows fill one more full batch on every rank.
        warnings.append(f'{samples_per_epoch - epoch_size:,} rows per epoch are trained twice: '
                        f'streaming pads the {world_size} ranks\' shares of {epoch_size:,} rows to '
                        f'equal length with repeats, which fill one more global batch of {G}; '
                        f'choose an epoch size or batch that divides evenly to avoid it')

    stream_plans = []
    for i, name in enumerate(names):
        m = manifests[name]
        n, choose = int(rows[i]), int(chooses[i])
        full, extra = divmod(choose, n)
        uniform = m.counts.tokens == n * L and m.counts.loss_tokens == n * L
        ratio = choose / n
        stream_plans.append(StreamPlan(
            name=name, kind=m.kind, rows=n, rows_per_epoch=choose, passes=ratio,
            full_passes=full, rows_seen_extra=extra, unseen_rows=n - extra if full == 0 else 0,
            share=choose / epoch_size if epoch_size else 0.0,
            trained_rows_per_epoch=int(per_epoch_counts[i]), slot_tokens_per_epoch=choose * L,
            tokens_per_epoch=m.counts.tokens * ratio, loss_tokens_per_epoch=m.counts.loss_tokens * ratio,
            tokens_exact=extra == 0 or uniform))
        if full == 0:
            warnings.append(f'{name}: under one pass ({ratio:.3g}x): {n - extra:,} of {n:,} rows '
                            f'are not seen in an epoch (a different random subset each epoch)')
    total_tok = sum(s.tokens_per_epoch for s in stream_plans) or 1.0
    total_loss = sum(s.loss_tokens_per_epoch for s in stream_plans) or 1.0
    for s in stream_plans:
        s.token_share = s.tokens_per_epoch / total_tok
        s.loss_token_share = s.loss_tokens_per_epoch / total_loss
    if not all(s.tokens_exact for s in stream_plans):
        notes.append('~ marks expected token counts: a fractional pass picks a random subset of '
                     'rows each epoch, so real/loss tokens vary slightly around this value')

    plan = Plan(streams=stream_plans, epoch_size=epoch_size, batch_size=batch_size,
                world_size=world_size, global_batch_size=G, batches_per_epoch=batches_per_epoch,
                samples_per_epoch=samples_per_epoch, max_seq_len=L,
                batching_method=c.batching_method, shuffle_seed=c.shuffle_seed,
                warnings=warnings, notes=notes)
    if max_duration is not None:
        plan.duration = _duration(plan, max_duration, names, per_epoch_counts, trained_counts,
                                  whole_batches)
        d = plan.duration
        if d.ends_mid_epoch:
            warnings.append(
                f'max_duration {d.max_duration} ends mid-epoch: epoch {d.last_epoch} stops after '
                f'{d.last_batch_in_epoch:,} of {batches_per_epoch:,} batches (sample '
                f'{d.last_sample_in_epoch:,} of {samples_per_epoch:,}); the rest of that epoch\'s '
                f'rows are not trained')
    return plan


def _duration(plan: Plan, max_duration: Any, names: list[str], per_epoch_counts: np.ndarray,
              trained_counts: Any, whole_batches: bool) -> DurationPlan:
    value, unit = parse_duration(max_duration)
    G, L, bpe = plan.global_batch_size, plan.max_seq_len, plan.batches_per_epoch
    if bpe <= 0:
        raise ConfigError(f'an epoch has no full global batch of {G} rows (epoch size '
                          f'{plan.epoch_size}); lower the batch size or add rows')
    if unit == 'ep':
        total_batches = value * bpe
    elif unit == 'ba':
        total_batches = value
    elif unit == 'sp':
        total_batches = math.ceil(value / G)  # Composer stops after the batch that reaches it
    else:
        total_batches = math.ceil(value / (G * L))
    full_epochs, rem = divmod(total_batches, bpe)
    if rem:
        last_epoch, last_batch = full_epochs, rem
    else:
        last_epoch, last_batch = full_epochs - 1, bpe
    rows_per_stream: Optional[dict[str, int]] = None
    simulated = (0 if whole_batches else (full_epochs - 1) * plan.epoch_size) + \
        (plan.epoch_size if rem else 0)
    if simulated <= SIMULATE_LIMIT:
        totals = np.zeros(len(names), np.int64)
        for epoch in range(full_epochs):
            totals += per_epoch_counts if (whole_batches or epoch == 0) else trained_counts(epoch)[0]
        if rem:
            totals += trained_counts(full_epochs, rem)[0]
        rows_per_stream = {n: int(v) for n, v in zip(names, totals)}
    return DurationPlan(
        max_duration=f'{value}{unit}', unit=DURATION_UNITS[unit], value=value,
        total_batches=total_batches, total_samples=total_batches * G,
        total_tokens=total_batches * G * L, epochs=total_batches / bpe, full_epochs=full_epochs,
        ends_mid_epoch=bool(rem), last_epoch=last_epoch, last_batch_in_epoch=last_batch,
        last_sample_in_epoch=last_batch * G, rows_per_stream=rows_per_stream)

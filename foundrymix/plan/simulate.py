"""Replay streaming's own sample order for an epoch, from index files only.

Why replay instead of arithmetic: when an epoch is not made of whole global batches, or
the batching method drops rows (``stratified``), or streaming pads ranks' shares with
repeats, which rows are trained depends on streaming's shuffle and partition. The plan
runs streaming's own ``generate_work`` (resampling, shuffling and partitioning code
borrowed as-is) on a stand-in dataset built from ``index.json`` files, then cuts each
worker's samples into DataLoader batches as the DataLoader does. No shard is read and
no dataset is constructed (which would register shared memory and scan caches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
from streaming import StreamingDataset

from foundrymix.plan.config import LoaderConfig

#: epochs' sample orders are generated for exact per-stream counts only up to this many samples
SIMULATE_LIMIT = 20_000_000


@dataclass(frozen=True)
class Topology:
    """Where the batches go: nodes x ranks per node, each rank with the loader's workers."""

    nodes: int = 1
    ranks_per_node: int = 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


class PlanDataset:
    """The attributes streaming's ``generate_work`` reads, built from index files only."""

    resample_streams = StreamingDataset.resample_streams

    def __init__(self, config: LoaderConfig, streams: list[Any], shard_rows: list[list[int]],
                 epoch_size: int, batch_size: int, num_nodes: int) -> None:
        c = config
        self.streams = streams
        self.num_streams = len(streams)
        self.epoch_size = epoch_size
        self.batch_size = batch_size
        self.batching_method = c.batching_method
        self.shuffle = c.shuffle
        self.shuffle_seed = c.shuffle_seed
        self.shuffle_algo = c.shuffle_algo
        self.sampling_method = c.sampling_method
        self.sampling_granularity = c.sampling_granularity
        self.partition_algo = c.partition_algo
        self.epoch_seed_change = c.shuffle and c.sampling_method == 'balanced'
        self.initial_physical_nodes = None
        # As StreamingDataset._resume defaults them on a fresh start (foundrymix fixes it).
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


def rank_orders(ds: PlanDataset, epoch: int, topology: Topology, num_workers: int,
                drop_last: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every rank's (sample ids in training order, rows of each batch) of one epoch (global
    rank order), as its DataLoader yields them.

    Each rank's DataLoader takes its workers' sample streams (streaming's partition,
    ``-1`` padding skipped), cuts each into ``batch_size`` batches (dropping a short last
    one if ``drop_last``) and yields them worker by worker in turn. Vectorized: a list of
    batch arrays cost 0.7 s of Python per replay of 1.4M rows (issue 22).
    """
    from streaming.base.batching import generate_work
    from streaming.base.world import World

    workers = max(1, num_workers)
    world = World(topology.nodes, topology.ranks_per_node, workers, 0)
    work = generate_work(ds.batching_method, ds, world, epoch, 0)
    B = ds.batch_size
    out = []
    for node in range(topology.nodes):
        for rank in range(topology.ranks_per_node):
            ids, starts, lens, index, worker = [], [], [], [], []
            offset = 0
            for w in range(workers):
                got = work[node, rank, w].reshape(-1)
                got = got[got != -1]
                first = np.arange(0, len(got), B, dtype=np.int64)
                size = np.minimum(B, len(got) - first)
                if drop_last:
                    first, size = first[size == B], size[size == B]
                ids.append(got)
                starts.append(first + offset)
                lens.append(size)
                index.append(np.arange(len(first), dtype=np.int64))
                worker.append(np.full(len(first), w, np.int64))
                offset += len(got)
            order = np.lexsort((np.concatenate(worker), np.concatenate(index)))
            first, size = np.concatenate(starts)[order], np.concatenate(lens)[order]
            before = np.cumsum(size) - size
            gather = np.repeat(first - before, size) + np.arange(int(size.sum()), dtype=np.int64)
            out.append((np.concatenate(ids).astype(np.int64)[gather], size))
    return out


def _split(order: tuple[np.ndarray, np.ndarray]) -> list[np.ndarray]:
    ids, sizes = order
    return np.split(ids, np.cumsum(sizes)[:-1]) if len(sizes) else []


def rank_batches(ds: PlanDataset, epoch: int, topology: Topology, num_workers: int,
                 drop_last: bool) -> list[list[np.ndarray]]:
    """Every rank's batches of one epoch (global rank order): :func:`rank_orders` cut."""
    return [_split(o) for o in rank_orders(ds, epoch, topology, num_workers, drop_last)]


def epoch_batches(ds: PlanDataset, epoch: int, topology: Topology, num_workers: int,
                  drop_last: bool) -> list[np.ndarray]:
    """The global batches of one epoch, in training order: global batch ``k`` is batch ``k``
    of every rank (ranks step together, so the shortest rank ends the epoch)."""
    per_rank = rank_batches(ds, epoch, topology, num_workers, drop_last)
    n = min(len(r) for r in per_rank)
    return [np.concatenate([r[k] for r in per_rank]) for k in range(n)]


class EpochSimulator:
    """Rows trained per stream in (a prefix of) an epoch, by replaying streaming's order."""

    def __init__(self, ds: PlanDataset, topology: Topology, config: LoaderConfig) -> None:
        self.ds = ds
        self.topology = topology
        self.num_workers = config.num_workers
        self.drop_last = config.drop_last
        self._epoch: Optional[tuple[int, list[tuple[np.ndarray, np.ndarray]]]] = None
        #: stratified: rows of each stream in every global batch (None: not stratified, or a
        #: stream with no row per batch, which streaming refuses -- the replay raises it)
        self.portions: Optional[np.ndarray] = None
        if ds.batching_method == 'stratified':
            from foundrymix.plan.exact import stratified_portions
            G = ds.batch_size * topology.world_size
            portions = np.array(stratified_portions([float(s.proportion) for s in ds.streams], G))
            self.portions = portions if portions.min() > 0 else None
        #: why prefix counts need the replay (None: arithmetic, see :func:`prefix_counts`)
        self.replay_reason = None if self.portions is not None else \
            random_arith_reason(ds, topology)

    @property
    def arithmetic(self) -> bool:
        """Whether counts over any prefix of an epoch are computed without the replay."""
        return self.replay_reason is None

    def stratified_batches(self) -> int:
        assert self.portions is not None
        return stratified_batches(self.ds, self.portions.tolist(), self.topology)

    def prefix_counts(self, epoch: int, n_batches: int) -> np.ndarray:
        """Rows per stream in the first ``n_batches`` global batches of ``epoch``, by
        arithmetic (:attr:`arithmetic` must hold); equal to :meth:`counts_and_sizes`'."""
        if self.portions is not None:
            return self.portions * min(n_batches, self.stratified_batches())
        G = self.ds.batch_size * self.topology.world_size
        return prefix_counts(self.ds, epoch, min(n_batches * G, self.ds.epoch_size))

    def arith_rank_counts(self) -> Optional[list[np.ndarray]]:
        """Every rank's rows per stream of a whole epoch without the replay, or None.

        Stratified: rank ``q`` takes columns ``[qB, (q+1)B)`` of every global batch. Random:
        when every rank owns whole canonical nodes (``CN`` a multiple of the world size),
        rank ``q`` (``local x nodes + node``) owns canonical nodes ``c = q mod W``, whose rows
        per stream do not depend on the order inside them."""
        W, B = self.topology.world_size, self.ds.batch_size
        if self.portions is not None:
            cols = np.concatenate(([0], np.cumsum(self.portions)))
            batches = self.stratified_batches()
            return [batches * np.maximum(0, np.minimum(cols[1:], (q + 1) * B) -
                                         np.maximum(cols[:-1], q * B)) for q in range(W)]
        CN = self.ds.num_canonical_nodes
        if not self.arithmetic or CN % W:
            return None
        per_cn = canonical_node_counts(self.ds, 0)
        P, R = self.topology.nodes, self.topology.ranks_per_node
        out = []
        for rank in range(W):  # global rank order: node-major
            q = (rank % R) * P + rank // R
            out.append(sum(per_cn[c] for c in range(q, CN, W)))
        return out

    def rank_orders(self, epoch: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """:func:`rank_orders` of ``epoch``, the last epoch's kept: a plan asks for epoch 0's
        per-stream counts, its per-rank counts and the rows of its first batches, and each
        replay is a full ``generate_work`` (1.1 s of a 2.2 s raw start over 1,000 streams,
        issue 22) -- one replay serves them all."""
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, rank_orders(self.ds, epoch, self.topology, self.num_workers,
                                              self.drop_last))
        return self._epoch[1]

    def trained_counts(self, epoch: int, n_batches: Optional[int] = None) -> tuple[np.ndarray, int]:
        """(rows trained per stream, batches) of epoch ``epoch``, or of its first ``n_batches``."""
        counts, sizes = self.counts_and_sizes(epoch, n_batches)
        return counts, len(sizes)

    def counts_and_sizes(self, epoch: int, n_batches: Optional[int] = None
                         ) -> tuple[np.ndarray, list[int]]:
        """(rows trained per stream, rows in each global batch) of epoch ``epoch`` (or of its
        first ``n_batches``). Without ``drop_last`` a worker's last batch of an epoch is short
        (and several workers' short batches fall inside the epoch, not only at its end); the
        sizes depend on the epoch's length and the topology only, not on its shuffle."""
        per_rank = self.rank_orders(epoch)
        n = min(len(sizes) for _, sizes in per_rank)
        if n_batches is not None:
            n = min(n, n_batches)
        sizes = [int(v) for v in sum((r[1][:n] for r in per_rank), np.zeros(n, np.int64))]
        ids = np.concatenate([r[0][:int(r[1][:n].sum())] for r in per_rank])
        return self._stream_counts(ids), sizes

    def _stream_counts(self, ids: np.ndarray) -> np.ndarray:
        stream_ids = np.searchsorted(self.ds.sample_offset_per_stream, ids, side='right') - 1
        return np.bincount(stream_ids, minlength=self.ds.num_streams).astype(np.int64)

    def rank_counts(self, epoch: int) -> list[tuple[np.ndarray, int]]:
        """(rows trained per stream, batches) of every rank in epoch ``epoch`` (global rank
        order), counting only the batches all ranks step through together."""
        per_rank = self.rank_orders(epoch)
        n = min(len(sizes) for _, sizes in per_rank)
        return [(self._stream_counts(ids[:int(sizes[:n].sum())]), n) for ids, sizes in per_rank]


# ------------------------------------------------------------------------------------------
# Arithmetic instead of the replay (issue 22): the per-stream counts a plan needs, from
# streaming's partition and shuffle structure, without materializing an epoch's sample ids.
#
# Why it is exact (streaming 0.13, read from its source): ``resample_streams`` lays the
# epoch's "big" sample ids out stream by stream, so a big id's stream is known from the
# streams' ``choose`` alone, and each shuffle unit (a span) lies in one stream. With
# ``batching_method: random``, an epoch of whole global batches, ``epoch_size`` a multiple
# of ``num_canonical_nodes`` and no node padding, ``get_partitions_orig`` pads and repeats
# nothing, and the first ``k`` global batches are the first ``k x G`` entries of the
# canonical order: canonical node ``c`` contributes the first ``ceil((kG - c) / CN)`` of its
# positions. ``get_shuffle`` fills canonical node ``c``'s positions with its own spans
# (``divide_spans`` cuts at the same ``c x N // CN`` boundaries), so a prefix count per
# stream needs only which spans fill a prefix of each canonical node:
#   * py1s: the spans in their epoch order (the shuffle inside a span moves no row to another
#     stream) -- O(spans);
#   * py1e: each row's position is shifted by a bounded uniform draw and sorted; every RNG
#     draw is replayed in streaming's order (the in-span shuffles on a scratch buffer, which
#     draws exactly as shuffling the ids does), the shifts are skipped with ``advance`` and
#     drawn only for the spans that can straddle the prefix's end -- O(rows) of RNG at ~11 ns
#     a row, O(spans + 2.5 x shuffle_block_size) memory. Exact unless two float64 positions
#     tie (streaming's argsort is unstable), which has probability ~2^-52 per pair.
# ``stratified`` batching puts the same rows of every stream in every global batch, at fixed
# columns: counts are batches x portions, per rank the overlap of its columns, for any epoch,
# shuffle or prefix. The replay (``rank_orders``) stays the test oracle (tests/plan/test_arith.py).
# ------------------------------------------------------------------------------------------

#: shuffle algorithms whose prefix counts are computed without the replay
ARITH_SHUFFLES = ('py1s', 'py1e')


def stratified_batches(ds: PlanDataset, portions: list[int], topology: Topology) -> int:
    """Global batches per epoch of stratified batching, as ``generate_work_stratified_batching``
    makes them: each stream's partition (batch 1, one node) holds ``ceil(ceil(n/CN) CN / R) R``
    real entries, its worker padding (-1) falls after them in traversal order, and only whole
    portions count; the least stream decides."""
    CN, R = ds.num_canonical_nodes, topology.ranks_per_node
    real = [-(-(-(-int(s.choose) // CN) * CN) // R) * R for s in ds.streams]
    return min(n // p for n, p in zip(real, portions))


def random_arith_reason(ds: PlanDataset, topology: Topology) -> Optional[str]:
    """None when prefix counts of ``random`` batching are arithmetic; else why not."""
    N, CN, P = ds.epoch_size, ds.num_canonical_nodes, topology.nodes
    G = ds.batch_size * topology.world_size
    if ds.batching_method != 'random':
        return f'batching_method {ds.batching_method}'
    if N % G or N % CN or N <= CN:
        return 'the epoch is not whole global batches over the canonical nodes'
    if P > CN and (P % CN or (N // CN) % (P // CN)):
        return 'physical nodes pad the canonical nodes'
    if ds.shuffle and ds.shuffle_algo not in ARITH_SHUFFLES:
        return f'shuffle_algo {ds.shuffle_algo} (arithmetic for {", ".join(ARITH_SHUFFLES)})'
    return None


def shuffle_units(ds: PlanDataset, epoch: int) -> np.ndarray:
    """``resample_streams(epoch)``'s shuffle units without its sample ids (which would be the
    epoch's size in int64): the same ``get_sampling`` per stream, units per shard."""
    from streaming.base.sampling import get_sampling
    units = []
    for s in range(ds.num_streams):
        first = ds.shard_offset_per_stream[s]
        rows = ds.samples_per_shard[first:first + ds.shards_per_stream[s]]
        chosen = get_sampling(rows, int(ds.streams[s].choose), ds.sampling_granularity,
                              ds.shuffle_seed, epoch, ds.epoch_seed_change)
        for n, c in zip(rows.tolist(), np.asarray(chosen).tolist()):
            units += [n] * (c // n) + ([c % n] if c % n else [])
    return np.array(units, np.int64)


def prefix_counts(ds: PlanDataset, epoch: int, prefix: int) -> np.ndarray:
    """Rows per stream among the first ``prefix`` samples of epoch ``epoch``'s global order
    (random batching; :func:`random_arith_reason` must be None)."""
    CN, N = ds.num_canonical_nodes, ds.epoch_size
    c = np.arange(CN, dtype=np.int64)
    take = np.maximum(0, (prefix - c + CN - 1) // CN)  # positions of each canonical node
    bounds = np.concatenate(([0], np.cumsum([int(s.choose) for s in ds.streams])))
    out = np.zeros(ds.num_streams, np.int64)
    if not ds.shuffle:  # position p is big id p
        starts = c * N // CN
        for a, m in zip(starts.tolist(), take.tolist()):
            out += _interval_counts(bounds, a, a + m)
        return out
    sizes, stream, supers, rng = _epoch_spans(ds, epoch, bounds)
    if ds.shuffle_algo == 'py1s':
        for (begin, end), m in zip(supers, take.tolist()):
            out += _span_prefix(sizes[begin:end], stream[begin:end], m, ds.num_streams)
        return out
    scratch = np.empty(int(sizes.max()) if len(sizes) else 0, np.int64)
    for (begin, end), m in zip(supers, take.tolist()):
        out += _py1e_prefix(sizes[begin:end], stream[begin:end], m, rng, ds.shuffle_block_size,
                            scratch, ds.num_streams)
    return out


def _epoch_spans(ds: PlanDataset, epoch: int, bounds: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]], np.random.Generator]:
    """(span sizes, span streams, each canonical node's spans, the epoch RNG after the span
    order) as py1s/py1e make them: the run's shard order, ``divide_spans``, the epoch's order
    of each canonical node's spans."""
    from streaming.base.shuffle.py1s import divide_spans
    units = shuffle_units(ds, epoch)
    ends = np.cumsum(units)
    spans = list(zip((ends - units).tolist(), ends.tolist()))
    np.random.default_rng(ds.shuffle_seed).shuffle(spans)
    spans, supers = divide_spans(spans, int(ends[-1]), ds.num_canonical_nodes)
    rng = np.random.default_rng(ds.shuffle_seed + epoch)
    for begin, end in supers:
        part = spans[begin:end]
        rng.shuffle(part)
        spans[begin:end] = part
    arr = np.array(spans, np.int64).reshape(-1, 2)
    return arr[:, 1] - arr[:, 0], np.searchsorted(bounds, arr[:, 0], side='right') - 1, supers, rng


def canonical_node_counts(ds: PlanDataset, epoch: int) -> np.ndarray:
    """Rows per stream of each canonical node's whole share of ``epoch`` (CN x streams):
    which spans a canonical node holds does not depend on their order inside it."""
    CN, N = ds.num_canonical_nodes, ds.epoch_size
    bounds = np.concatenate(([0], np.cumsum([int(s.choose) for s in ds.streams])))
    if not ds.shuffle:
        return np.stack([_interval_counts(bounds, c * N // CN, (c + 1) * N // CN)
                         for c in range(CN)])
    sizes, stream, supers, _ = _epoch_spans(ds, epoch, bounds)
    return np.stack([np.bincount(stream[a:b], weights=sizes[a:b], minlength=ds.num_streams)
                     for a, b in supers]).astype(np.int64)


def _interval_counts(bounds: np.ndarray, a: int, b: int) -> np.ndarray:
    """Rows per stream of big ids ``[a, b)`` (streams own ``[bounds[s], bounds[s+1])``)."""
    return np.maximum(0, np.minimum(bounds[1:], b) - np.maximum(bounds[:-1], a))


def _span_prefix(sizes: np.ndarray, stream: np.ndarray, m: int, n_streams: int) -> np.ndarray:
    """Rows per stream of the first ``m`` rows of spans laid end to end."""
    ends = np.cumsum(sizes)
    took = np.clip(m - (ends - sizes), 0, sizes)
    return np.bincount(stream, weights=took, minlength=n_streams).astype(np.int64)


def _py1e_prefix(sizes: np.ndarray, stream: np.ndarray, m: int, rng: np.random.Generator,
                 block_size: int, scratch: np.ndarray, n_streams: int) -> np.ndarray:
    """Rows per stream of the first ``m`` rows of one canonical node under ``get_shuffle_py1e``,
    drawing from ``rng`` exactly what streaming draws (so the next canonical node continues
    from the same state); a row's value is ``float64(position) + shift`` as there."""
    num = int(sizes.sum())
    for s in sizes.tolist():  # in-span shuffles: random_interval draws depend on length only
        rng.shuffle(scratch[:s])
    bg = rng.bit_generator
    offsets = np.cumsum(sizes) - sizes
    lows, highs, states = [], [], []
    offset = 0
    for span_size in sizes:  # numpy int64, as streaming's cn_span_sizes
        rand_block_size = rng.integers(int(0.75 * block_size), int(1.25 * block_size))
        cutoff = (rand_block_size - span_size) / 2
        if cutoff < 0:
            cutoff = 0
        lows.append(max(-cutoff, -offset))
        highs.append(min(cutoff, num - offset - span_size))
        states.append(_skip_doubles(bg, int(span_size)))
        offset += span_size
    if m <= 0:
        return np.zeros(n_streams, np.int64)
    if m >= num:
        return np.bincount(stream, weights=sizes, minlength=n_streams).astype(np.int64)
    lo = offsets + np.array(lows, np.float64)
    hi = offsets + sizes - 1 + np.array(highs, np.float64)
    width = float(max(np.max(hi - lo), 1.0))
    draw = np.random.Generator(type(bg)())
    while True:
        t_low, t_high = m - width, m + width
        sure_in, sure_out = hi < t_low, lo > t_high
        unsure = np.flatnonzero(~sure_in & ~sure_out)
        k = m - int(sizes[sure_in].sum())
        values, owners = [], []
        for i in unsure.tolist():
            draw.bit_generator.state = states[i]
            shifts = draw.uniform(low=lows[i], high=highs[i], size=int(sizes[i]))
            values.append(np.arange(offsets[i], offsets[i] + sizes[i]).astype(np.float64) + shifts)
            owners.append(np.full(int(sizes[i]), stream[i], np.int64))
        v = np.concatenate(values) if values else np.zeros(0)
        if 0 <= k <= len(v):
            # the k smallest (O(n) selection: a full argsort of the ~2.5 blocks was 8 s of 37)
            order = np.argpartition(v, [i for i in (k - 1, k) if 0 <= i < len(v)]) \
                if len(v) else np.zeros(0, np.int64)
            if (k == 0 or v[order[k - 1]] <= t_high) and (k == len(v) or v[order[k]] >= t_low):
                counts = np.bincount(stream[sure_in], weights=sizes[sure_in], minlength=n_streams)
                if k:
                    counts += np.bincount(np.concatenate(owners)[order[:k]], minlength=n_streams)
                return counts.astype(np.int64)
        width *= 2


def _skip_doubles(bg: Any, n: int) -> dict[str, Any]:
    """Advance ``bg`` past ``n`` doubles (``uniform`` takes one 64-bit draw each) keeping its
    buffered 32-bit half, which ``advance`` clears but ``integers`` may still use; returns
    the state before (to draw those doubles later)."""
    kept = bg.state
    bg.advance(n)
    if kept['has_uint32']:
        state = bg.state
        state['has_uint32'], state['uinteger'] = 1, kept['uinteger']
        bg.state = state
    return kept

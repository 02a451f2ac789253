"""The sample order: a pure function of (stage counts, seed) from a global position to (stream, row):
blocks of exact per-stream counts halved down to shuffled leaves; pass-complete draws per stream, a
window of shards at a time; O(1) seek on any topology; integer seeds only (docs/mixing-and-plan.md)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterator, Sequence

import numpy as np

from foundrymix.plan.exact import apportion

#: positions in one leaf of a block (its stream pattern is shuffled as a whole)
LEAF = 1 << 16
#: default rows of a shuffle window of one stream's pass (``shuffle_block_size``)
WINDOW_ROWS = 1 << 18


def name_key(name: str) -> int:
    """A stable 63-bit integer for a name (a stream's or stage's), for seeding."""
    return int.from_bytes(hashlib.sha256(name.encode('utf-8')).digest()[:8], 'little') >> 1


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(k) for k in key])))


# ------------------------------------------------------------------------------- draws
class StreamDraws:
    """Stream ``i``'s draws in one stage: draw ``t`` -> row. Pass ``p`` permutes the shards, cuts
    them into windows of about ``window_rows`` rows and permutes each window's rows, all seeded."""

    def __init__(self, shard_rows: Sequence[int], key: tuple[int, ...], window_rows: int = WINDOW_ROWS,
                 shuffle: bool = True) -> None:
        self.shard_rows = np.asarray(shard_rows, np.int64)
        self.shard_start = np.concatenate(([0], np.cumsum(self.shard_rows)[:-1])).astype(np.int64)
        self.rows = int(self.shard_rows.sum())
        self.key = tuple(int(k) for k in key)
        self.window_rows = max(1, int(window_rows))
        self.shuffle = shuffle
        self._pass: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._window: tuple[int, int, np.ndarray] | None = None

    def _pass_layout(self, p: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shards in pass order, each window's first draw, each window's first shard index)."""
        if self._pass is not None and self._pass[0] == p:
            return self._pass[1], self._pass[2], self._pass[3]
        n = len(self.shard_rows)
        order = _rng(*self.key, p).permutation(n) if self.shuffle else np.arange(n)
        rows = self.shard_rows[order]
        starts = np.cumsum(rows) - rows
        # a window: the shards whose first row falls in one span of window_rows draws
        bucket = starts // self.window_rows
        shard_first = np.flatnonzero(np.diff(bucket, prepend=-1) > 0).astype(np.int64)
        ends = np.cumsum(rows)
        draw_first = np.concatenate(([0], ends))[shard_first].astype(np.int64)
        self._pass = (p, order, draw_first, shard_first)
        return order, draw_first, shard_first

    def _window_rows(self, p: int, w: int) -> np.ndarray:
        """Rows of window ``w`` of pass ``p``, in the order they are drawn."""
        if self._window is not None and self._window[:2] == (p, w):
            return self._window[2]
        order, _, shard_first = self._pass_layout(p)
        end = shard_first[w + 1] if w + 1 < len(shard_first) else len(order)
        shards = order[shard_first[w]:end]
        rows = np.concatenate([np.arange(self.shard_start[s], self.shard_start[s] + self.shard_rows[s])
                               for s in shards.tolist()]) if len(shards) else np.zeros(0, np.int64)
        if self.shuffle:
            rows = _rng(*self.key, p, w + 1).permutation(rows)
        self._window = (p, w, rows)
        return rows

    def rows_of(self, draws: np.ndarray) -> np.ndarray:
        """The rows of draws ``draws`` (any order, any passes)."""
        draws = np.asarray(draws, np.int64)
        out = np.empty(len(draws), np.int64)
        if not len(draws):
            return out
        passes, within = np.divmod(draws, self.rows)
        for p in np.unique(passes).tolist():
            at = np.flatnonzero(passes == p)
            _, draw_first, _ = self._pass_layout(p)
            window = np.searchsorted(draw_first, within[at], side='right') - 1
            for w in np.unique(window).tolist():
                sel = at[window == w]
                out[sel] = self._window_rows(p, w)[within[sel] - draw_first[w]]
        return out


# ------------------------------------------------------------------------------- blocks
@dataclass(frozen=True)
class Block:
    """``counts[i]`` consecutive draws of stream ``i`` from its cursor ``start[i]``, laid out
    over ``sum(counts)`` positions; ``key`` seeds the layout's leaf shuffles."""

    counts: np.ndarray
    start: np.ndarray
    key: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(self.counts.sum())

    def leaves(self) -> int:
        return max(1, -(-self.size // LEAF))

    def leaf(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows of each stream in leaves before ``k``, rows of each stream in leaf ``k``)."""
        return _leaf(self.counts.tobytes(), self.counts.dtype.str, self.size, k)

    def pattern(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Leaf ``k``'s (stream of each position, index of that position among its stream's
        positions in the leaf, rows of each stream before the leaf)."""
        return _pattern(self.counts.tobytes(), self.counts.dtype.str, self.size, self.key, k)

    def prefix_counts(self, m: int) -> np.ndarray:
        """Rows of each stream among the block's first ``m`` positions."""
        m = min(max(int(m), 0), self.size)
        if m == self.size:
            return self.counts.copy()
        k, into = divmod(m, LEAF)
        before, _ = self.leaf(k)
        if not into:
            return before.copy()
        streams, _, _ = self.pattern(k)
        return before + np.bincount(streams[:into], minlength=len(self.counts))

    def draws(self, begin: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(stream, draw index) of positions ``[begin, end)`` of the block."""
        def leaf(k: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
            s, occ, before = self.pattern(k)
            s = s[lo:hi]
            return s, self.start[s] + before[s] + occ[lo:hi]
        return _pieces(begin, end, LEAF, leaf)

    def leaf_counts(self) -> Iterator[tuple[int, np.ndarray]]:
        """(k, rows of each stream in leaf ``k``) for every leaf in order, each node apportioned once."""
        stack = [(0, self.leaves(), self.counts.astype(np.int64))]
        while stack:
            lo, hi, counts = stack.pop()
            if hi - lo == 1:
                yield lo, counts
                continue
            mid = lo + (hi - lo) // 2
            left = apportion(counts, (mid - lo) * LEAF)
            stack.append((mid, hi, counts - left))
            stack.append((lo, mid, left))


def _pieces(begin: int, end: int, size: int, piece: Callable[[int, int, int], tuple[np.ndarray, np.ndarray]]
            ) -> tuple[np.ndarray, np.ndarray]:
    """(stream, draw) of positions ``[begin, end)`` cut into pieces of ``size`` positions:
    ``piece(i, lo, hi)`` gives those of positions ``[lo, hi)`` of piece ``i``."""
    streams, draws = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    pos = begin
    while pos < end:
        i, into = divmod(pos, size)
        upto = min(end, (i + 1) * size)
        s, t = piece(i, into, upto - i * size)
        streams.append(s)
        draws.append(t)
        pos = upto
    return np.concatenate(streams), np.concatenate(draws)


def leaf_streams(counts: np.ndarray, key: tuple[int, ...], k: int) -> np.ndarray:
    """The stream of each position of leaf ``k`` holding ``counts`` rows of each stream: a
    seeded shuffle of the streams' positions (in stream order unshuffled, ``key`` empty)."""
    streams = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    if len(streams) > 1 and key:
        streams = _rng(*key, k).permutation(streams)
    return streams


@lru_cache(maxsize=4)  # a batch touches one or two leaves; consecutive batches the same
def _pattern(counts_bytes: bytes, dtype: str, size: int, key: tuple[int, ...], k: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    before, counts = _leaf(counts_bytes, dtype, size, k)
    streams = leaf_streams(counts, key, k)
    order = np.argsort(streams, kind='stable')
    occurrence = np.empty(len(streams), np.int64)
    firsts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    occurrence[order] = np.arange(len(streams)) - np.repeat(firsts, counts)
    for a in (streams, occurrence):
        a.flags.writeable = False
    return streams, occurrence, before


@lru_cache(maxsize=64)
def _leaf(counts_bytes: bytes, dtype: str, size: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Descend the halves of a block of ``size`` positions to leaf ``k`` (see :class:`Block`)."""
    counts = np.frombuffer(counts_bytes, dtype=dtype).astype(np.int64)
    before = np.zeros_like(counts)
    lo, hi = 0, max(1, -(-size // LEAF))  # leaves [lo, hi) hold `counts`
    node_size = size
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        left = apportion(counts, (mid - lo) * LEAF)
        if k < mid:
            counts, hi, node_size = left, mid, (mid - lo) * LEAF
        else:
            before = before + left
            counts, lo, node_size = counts - left, mid, node_size - (mid - lo) * LEAF
    before.flags.writeable = False
    counts.flags.writeable = False
    return before, counts


# ------------------------------------------------------------------------------- stages
class StageOrder:
    """One stage's order in global batches: block ``e`` takes stream ``i``'s draws from
    ``start[i] + e c_i`` on, ``start[i]`` being the draws of it earlier stages took, so repetition
    is pass-complete over the whole run, across stages."""

    def __init__(self, draws: Sequence[StreamDraws], block_counts: Sequence[int], global_batch: int,
                 key: tuple[int, ...], shuffle: bool = True, start: Sequence[int] | None = None) -> None:
        self.draws = list(draws)
        self.counts = np.asarray(block_counts, np.int64)
        self.global_batch = int(global_batch)
        self.key = tuple(int(k) for k in key)
        self.shuffle = shuffle
        self.start = np.zeros(len(self.counts), np.int64) if start is None else np.asarray(start, np.int64)
        self.block_size = int(self.counts.sum())
        if self.block_size <= 0:
            raise ValueError('a block holds no row')

    def block(self, e: int) -> Block:
        return Block(self.counts, self.start + e * self.counts, (*self.key, e) if self.shuffle else ())

    def batch(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(stream, row) of each of global batch ``b``'s rows (0-based within the stage)."""
        G = self.global_batch
        return rows_of(self.draws, *_pieces(b * G, (b + 1) * G, self.block_size,
                                             lambda e, lo, hi: self.block(e).draws(lo, hi)))

    def trained(self, batches: int) -> np.ndarray:
        """Rows of each stream in the stage's first ``batches`` global batches (arithmetic)."""
        full, into = divmod(batches * self.global_batch, self.block_size)
        out = self.counts * full
        if into:
            out = out + self.block(full).prefix_counts(into)
        return out


def rank_counts(order: StageOrder, batches: int, world: int) -> np.ndarray:
    """Rows of each stream (columns) each of ``world`` ranks (rows) trains in the first ``batches``
    global batches: counted, as a rank's share of a leaf depends on the leaf's shuffle."""
    G, n = order.global_batch, len(order.counts)
    B = G // world
    total = batches * G
    out = np.zeros(world * n, np.int64)
    for e in range(-(-total // order.block_size)):
        block, base = order.block(e), e * order.block_size
        for k, counts in block.leaf_counts():
            begin = base + k * LEAF
            if begin >= total:
                break
            streams = leaf_streams(counts, block.key, k)[:total - begin]
            cols = _columns(begin % G, len(streams), G, B)
            out += np.bincount(cols * n + streams, minlength=world * n)
    return out.reshape(world, n)


@lru_cache(maxsize=8)
def _columns(offset: int, m: int, G: int, B: int) -> np.ndarray:
    """The rank of each of ``m`` positions from one that is ``offset`` into a global batch."""
    return (offset + np.arange(m, dtype=np.int64)) % G // B


def rows_of(draws: Sequence[StreamDraws], streams: np.ndarray, index: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """(stream, row) of draws ``index[j]`` of streams ``streams[j]``."""
    rows = np.empty(len(streams), np.int64)
    for s in np.unique(streams).tolist():
        at = streams == s
        rows[at] = draws[s].rows_of(index[at])
    return streams, rows


def stream_draws(shard_rows: Sequence[Sequence[int]], names: Sequence[str], seed: int, stage: str,
                 window_rows: int = WINDOW_ROWS, shuffle: bool = True) -> list[StreamDraws]:
    """Every stream's draws as first used in stage ``stage``, keyed by names (stable when streams
    are added); a later stage reusing a stream goes on with these (``StageOrder``'s ``start``)."""
    return [StreamDraws(r, (seed, name_key(stage), name_key(n)), window_rows, shuffle)
            for r, n in zip(shard_rows, names)]

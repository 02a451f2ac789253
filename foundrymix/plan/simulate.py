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


def rank_batches(ds: PlanDataset, epoch: int, topology: Topology, num_workers: int,
                 drop_last: bool) -> list[list[np.ndarray]]:
    """Every rank's batches of one epoch (global rank order), as its DataLoader yields them.

    Each rank's DataLoader takes its workers' sample streams (streaming's partition,
    ``-1`` padding skipped), cuts each into ``batch_size`` batches (dropping a short last
    one if ``drop_last``) and yields them worker by worker in turn.
    """
    from streaming.base.batching import generate_work
    from streaming.base.world import World

    workers = max(1, num_workers)
    world = World(topology.nodes, topology.ranks_per_node, workers, 0)
    work = generate_work(ds.batching_method, ds, world, epoch, 0)
    per_rank = []
    for node in range(topology.nodes):
        for rank in range(topology.ranks_per_node):
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
    return per_rank


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
        batches = epoch_batches(self.ds, epoch, self.topology, self.num_workers, self.drop_last)
        if n_batches is not None:
            batches = batches[:n_batches]
        sizes = [len(b) for b in batches]
        n_streams = self.ds.num_streams
        if not batches:
            return np.zeros(n_streams, np.int64), sizes
        ids = np.concatenate(batches)
        stream_ids = np.searchsorted(self.ds.sample_offset_per_stream, ids, side='right') - 1
        return np.bincount(stream_ids, minlength=n_streams).astype(np.int64), sizes

    def rank_counts(self, epoch: int) -> list[tuple[np.ndarray, int]]:
        """(rows trained per stream, batches) of every rank in epoch ``epoch`` (global rank
        order), counting only the batches all ranks step through together."""
        per_rank = rank_batches(self.ds, epoch, self.topology, self.num_workers, self.drop_last)
        n = min(len(r) for r in per_rank)
        out = []
        for batches in per_rank:
            ids = np.concatenate(batches[:n]) if n else np.zeros(0, np.int64)
            stream_ids = np.searchsorted(self.ds.sample_offset_per_stream, ids, side='right') - 1
            out.append((np.bincount(stream_ids, minlength=self.ds.num_streams).astype(np.int64), n))
        return out

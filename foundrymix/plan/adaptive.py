"""Adaptive mixing: each segment's exact rows, decided from the all-reduced per-stream loss (or
replayed), drawn through per-stream cursors so no row repeats before its stream's pass is complete,
and the plan of an adaptive stage. A decision is a function of (state, summed loss) only, so it
is identical on every rank and on a resumed run (docs/adaptive.md)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from foundrymix.config import ConfigError
from foundrymix.plan.exact import apportion
from foundrymix.plan.order import Block, StreamDraws, rows_of
from foundrymix.plan.policies import ADOPolicy, FixedPolicy, ODMPolicy, Policy


def floor_shares(weights: np.ndarray, min_share: float) -> np.ndarray:
    """``weights`` normalized, with the shares below ``min_share`` raised to it and the others
    sharing the rest in their proportions (needs ``min_share x n <= 1``)."""
    w = np.asarray(weights, np.float64)
    w = w / w.sum()
    low = np.zeros(len(w), bool)
    while True:
        rest = 1.0 - min_share * low.sum()
        out = np.where(low, min_share, w * rest / w[~low].sum() if (~low).any() else 0.0)
        new = low | (out < min_share)
        if (new == low).all():
            return out
        low = new


# -------------------------------------------------------------------- decisions, ids
@dataclass
class Decision:
    """One segment: its first global batch, the weights decided for it, the whole rows per
    stream they make (what the segment trains exactly), and the loss it was decided from."""

    batch: int
    weights: list[float]
    rows: list[int]
    loss: Optional[list[Optional[float]]] = None   # mean loss per stream since the last update

    def to_dict(self) -> dict[str, Any]:
        return {'batch': self.batch, 'weights': self.weights, 'rows': self.rows, 'loss': self.loss}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> 'Decision':
        return cls(int(d['batch']), [float(w) for w in d['weights']], [int(r) for r in d['rows']],
                   d.get('loss'))


class AdaptiveError(RuntimeError):
    """The loader reached a segment whose weights nobody decided (no loss was fed)."""


@dataclass
class AdaptiveController:
    """One adaptive stage: segments of ``every`` batches, the policy (or ``replay``'s recorded
    decisions), every decision, and the per-stream cursors that turn one into sample ids."""

    method: str
    names: list[str]
    rows: list[int]
    initial: list[float]
    global_batch: int
    every: int
    warmup: int
    min_share: float
    seed: int
    start_batch: int
    batches: int
    options: dict[str, float] = field(default_factory=dict)
    replay: Optional[list[Decision]] = None
    decisions: list[Decision] = field(default_factory=list)
    #: each stream's draws, and those earlier stages took: the stage order's (its passes go on)
    draws: Optional[list[StreamDraws]] = None
    draws_before: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        initial = floor_shares(np.array(self.initial), self.min_share)
        self.initial = initial.tolist()
        policy = {'odm': ODMPolicy, 'ado': ADOPolicy}.get(self.method)
        self.policy: Policy = FixedPolicy(initial) if policy is None else policy(initial, **self.options)
        self.offsets = np.concatenate([[0], np.cumsum(self.rows)[:-1]]).astype(np.int64)
        if self.replay is not None:
            self._check_replay()
        if not self.decisions:
            self.decisions.append(self._decision(0, initial, None))

    def _check_replay(self) -> None:
        assert self.replay is not None
        want = [(self.segment_start(k), self.segment_batches(k) * self.global_batch)
                for k in range(self.segments)]
        got = [(d.batch, sum(d.rows)) for d in self.replay]
        if got[:len(want)] != want or len(got) < len(want) or \
                any(len(d.rows) != len(self.rows) for d in self.replay):
            raise ConfigError(
                f'adaptive.from: the recorded decisions do not fit this run: they start segments '
                f'at batches {[b for b, _ in got][:5]}... with {[r for _, r in got][:5]}... rows over '
                f'{len(self.replay[0].rows)} streams; this run needs {len(want)} segments at '
                f'{[b for b, _ in want][:5]}... with {[r for _, r in want][:5]}... rows over '
                f'{len(self.rows)} streams (same streams, every, batch size and duration)')

    # -- segments
    @property
    def segments(self) -> int:
        return -(-self.batches // self.every)

    def segment_of(self, batch: int) -> int:
        return (batch - self.start_batch) // self.every

    def segment_start(self, k: int) -> int:
        return self.start_batch + k * self.every

    def segment_batches(self, k: int) -> int:
        return min(self.every, self.batches - k * self.every)

    def _decision(self, k: int, weights: np.ndarray, loss: Optional[np.ndarray]) -> Decision:
        if self.replay is not None:
            return self.replay[k]
        rows = apportion(weights, self.segment_batches(k) * self.global_batch).tolist()
        lost = None if loss is None else [None if math.isnan(x) else float(x) for x in loss]
        return Decision(self.segment_start(k), [float(w) for w in weights], rows, lost)

    def update(self, loss_sum: np.ndarray, loss_tokens: np.ndarray) -> Decision:
        """The interval that just ended: its per-stream loss (summed over all ranks) -> the
        next segment's decision. Called once per segment boundary, in order."""
        k = len(self.decisions)
        if k >= self.segments:
            raise AdaptiveError(f'adaptive: all {self.segments} segments are decided')
        loss_sum = np.asarray(loss_sum, np.float64)
        tokens = np.asarray(loss_tokens, np.float64)
        with np.errstate(invalid='ignore', divide='ignore'):
            loss = np.where(tokens > 0, loss_sum / np.maximum(tokens, 1), np.nan)
        current = np.array(self.decisions[-1].weights)
        weights = self.policy.update(loss, current)
        if self.segment_start(k) < self.start_batch + self.warmup:
            weights = np.array(self.initial)
        weights = floor_shares(weights, self.min_share)
        decision = self._decision(k, weights, loss)
        self.decisions.append(decision)
        return decision

    def decision(self, k: int) -> Decision:
        if self.replay is not None:
            while len(self.decisions) <= k:
                self.decisions.append(self.replay[len(self.decisions)])
        if k >= len(self.decisions):
            raise AdaptiveError(
                f'adaptive: segment {k} (batch {self.segment_start(k)}) has no decision: the '
                f'per-stream loss of the segment before was not fed (the trainer\'s adaptive '
                f'callback does so; a loader used alone calls controller.update)')
        return self.decisions[k]

    # -- cursors
    def consumed_before(self, k: int) -> np.ndarray:
        """Rows each stream trained in segments ``0..k-1`` (its cursor at segment ``k``);
        the last answer is kept, so a run's next segment adds one decision's rows."""
        done, cursor = getattr(self, '_cursor', (0, np.zeros(len(self.rows), np.int64)))
        if done > k:
            done, cursor = 0, np.zeros(len(self.rows), np.int64)
        cursor = cursor.copy()
        for d in self.decisions[done:k]:
            cursor += np.asarray(d.rows, np.int64)
        self._cursor = (k, cursor)
        return cursor

    def segment_ids(self, k: int) -> np.ndarray:
        """Segment ``k``'s global sample ids, in training order: a block of the decided rows
        per stream from the streams' cursors, so a pass is finished before the next starts."""
        decision = self.decision(k)
        assert self.draws is not None and self.draws_before is not None
        block = Block(np.asarray(decision.rows, np.int64), self.draws_before + self.consumed_before(k),
                      (self.seed, len(self.rows), 1_000_003, k))
        streams, rows = rows_of(self.draws, *block.draws(0, block.size))
        return self.offsets[streams] + rows

    def stream_of(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, ids, side='right') - 1

    # -- state
    def state_dict(self) -> dict[str, Any]:
        return {'method': self.method, 'streams': list(self.names), 'every': self.every,
                'global_batch': self.global_batch, 'policy': self.policy.state_dict(),
                'decisions': [d.to_dict() for d in self.decisions]}

    def load_state_dict(self, state: dict[str, Any], batch: int) -> None:
        """Restore the policy and the decisions made up to ``batch`` (the resume position):
        a decision for a later segment cannot exist in a consistent checkpoint."""
        if list(state['streams']) != self.names or int(state['every']) != self.every \
                or int(state['global_batch']) != self.global_batch:
            raise AdaptiveError(
                f'adaptive: the checkpoint decided segments of {state["every"]} batches of '
                f'{state["global_batch"]} rows over streams {state["streams"]}; this run has '
                f'{self.every} x {self.global_batch} over {self.names}')
        self.policy.load_state_dict(state['policy'])
        self.decisions = [Decision.from_dict(d) for d in state['decisions']]
        self._cursor = (0, np.zeros(len(self.rows), np.int64))

    def report(self) -> dict[str, Any]:
        """``report/mixture.json``'s section of this stage (also what ``replay`` reads)."""
        return {**self.state_dict(), 'warmup': self.warmup, 'min_share': self.min_share,
                'seed': self.seed, 'start_batch': self.start_batch, 'batches': self.batches,
                'initial': list(self.initial)}


def read_replay(path: str, stage: str, where: str) -> list[Decision]:
    """The recorded decisions of ``stage`` in a ``mixture.json`` (``method: replay``)."""
    try:
        with open(path, encoding='utf-8') as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f'{where}.from: cannot read {path}: {e.strerror}; give the '
                          f'report/mixture.json an adaptive run wrote') from None
    except ValueError as e:
        raise ConfigError(f'{where}.from: {path} is not JSON ({e})') from None
    stages = data.get('stages') if isinstance(data, dict) else None
    if not isinstance(stages, dict) or stage not in stages:
        raise ConfigError(f'{where}.from: {path} records no adaptive stage {stage!r} (it has: '
                          f'{", ".join(stages or {}) or "none"})')
    return [Decision.from_dict(d) for d in stages[stage]['decisions']]


def build_controller(stage: Any) -> Optional[AdaptiveController]:
    """The controller of a planned adaptive stage (else None), starting from its planned
    shares; refused here, at plan time, when it cannot be met."""
    config = stage.config
    a = config.adaptive if config is not None else None
    if a is None:
        return None
    where = f'{stage.where}.adaptive'
    streams = stage.plan.streams
    if a.min_share * len(streams) > 1:
        raise ConfigError(f'{where}.min_share: {a.min_share} x {len(streams)} streams exceeds 1; '
                          f'give at most {1 / len(streams):.4g}')
    replay = read_replay(a.replay_from, stage.name, where) if a.replay_from else None
    options: dict[str, float] = ({'alpha': a.alpha, 'lr': a.lr} if a.method == 'odm' else
                                 {'alpha': a.alpha, 'beta': a.beta} if a.method == 'ado' else {})
    seed = config.shuffle_seed if a.seed is None else a.seed
    return AdaptiveController(
        method=a.method, names=[s.name for s in streams], rows=[s.rows for s in streams],
        initial=[s.share for s in streams], global_batch=stage.plan.global_batch_size,
        every=a.batches('every', where), warmup=a.batches('warmup', where),
        min_share=a.min_share, seed=seed,
        start_batch=stage.start_batch, batches=stage.batches, options=options, replay=replay,
        draws=stage.plan.order.draws, draws_before=stage.plan.order.start)


def plan_adaptive(plan: Any, controller: AdaptiveController) -> bool:
    """Restate an adaptive stage's plan (planned as epochs of its configured weights) as the
    segments it trains; True if its rows are exact. Exact at plan time: the segments whose
    weights are known (warmup, ``fixed``, ``replay``); the rest only have ``min_share`` floors."""
    c, d = controller, plan.duration
    known = np.zeros(len(c.names), np.int64)
    at_least = np.zeros(len(c.names), np.int64)
    undecided = [0, 0]   # batches, rows
    first = c.start_batch + c.batches  # the first batch decided during the run
    for k in range(c.segments):
        rows = c.segment_batches(k) * c.global_batch
        if c.replay is not None:
            known += c.replay[k].rows
        elif c.method == 'fixed' or c.segment_start(k) < c.start_batch + c.warmup:
            known += apportion(c.initial, rows)
        else:
            first = min(first, c.segment_start(k))
            undecided[0] += c.segment_batches(k)
            undecided[1] += rows
            at_least += int(c.min_share * rows)
    exact = undecided[0] == 0
    n_rows = dict(zip(c.names, c.rows))
    text = ', '.join(f'{n} {int(r):,}' for n, r in zip(c.names, known))
    if exact:
        how = 'the recorded decisions' if c.replay is not None else 'the configured weights'
        plan.counted = {'run': f'adaptive ({c.method}): every segment\'s whole rows from {how}'}
    else:
        floors = ', '.join(f'{n} {int(r):,}' for n, r in zip(c.names, at_least))
        decided = (f'batches {c.start_batch:,}-{first - 1:,} exact at the configured weights ({text}); '
                   f'batches {first:,}-{c.start_batch + c.batches - 1:,} ({undecided[1]:,} rows)'
                   if first > c.start_batch else f'all {undecided[1]:,} rows')
        plan.counted = {'run': f'adaptive ({c.method}): {decided} decided during the run from the '
                               f'per-stream loss, each stream at least {floors}'}
    if d is not None:
        d.rows_per_stream = {n: int(r) for n, r in zip(c.names, known)} if exact else None
        d.passes_per_stream = {n: int(r) / n_rows[n] for n, r in zip(c.names, known)} if exact else None
    plan.adaptive = True
    plan.warnings = [w for w in plan.warnings if w.startswith('proportions sum to')]
    plan.notes = [n for n in plan.notes if not n.startswith(('exact epoch:', '~ marks'))]
    if exact:
        plan.warnings += [f'{n}: under one pass: {n_rows[n] - int(r):,} of {n_rows[n]:,} rows are '
                          f'not trained' for n, r in zip(c.names, known) if r < n_rows[n]]
    plan.notes.append(
        f'adaptive ({c.method}, every {c.every}ba from batch {c.start_batch + c.warmup:,}, '
        f'min_share {c.min_share}): the table shows the configured start (its per-epoch columns '
        f'are the configured mixture\'s epochs); the stage trains segments of whole rows per stream '
        f'read by per-stream cursors, no row repeated before its stream\'s pass is complete '
        f'(report/mixture.json, docs/adaptive.md)')
    return exact

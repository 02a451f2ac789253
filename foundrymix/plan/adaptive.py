"""Adaptive mixing: each segment's exact rows, decided from the all-reduced per-stream loss (or
replayed), drawn through per-stream cursors so no row repeats before its stream's pass is complete,
and the plan of an adaptive stage. A decision (a policy's) is a function of (state, summed loss)
only, and the state plain floats, so it is identical on every rank and on a resumed run
(docs/adaptive.md)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import numpy as np

from foundrymix.config import ConfigError
from foundrymix.plan.exact import apportion
from foundrymix.plan.order import Block, StreamDraws, rows_of
from foundrymix.plan.plans import Plan


# -------------------------------------------------------------------- policies
class Policy:
    """Maps the last interval's per-stream mean loss (NaN: no loss tokens) to the next
    interval's weights; its state is plain floats, restored bitwise. This base keeps the
    configured weights throughout (``fixed``: the baseline an adaptive run is compared with)."""

    def __init__(self, initial: np.ndarray) -> None:
        self.initial = np.asarray(initial, np.float64)

    def update(self, loss: np.ndarray, weights: np.ndarray) -> np.ndarray:
        return self.initial.copy()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class ODMPolicy(Policy):
    """ODM (Albalak et al. 2023): EXP3 over streams, rewarded by training loss; a mixed interval
    observes every stream, so every estimate is updated each time (docs/adaptive.md)."""

    def __init__(self, initial: np.ndarray, alpha: float = 0.9, lr: float = 1.0) -> None:
        super().__init__(initial)
        self.alpha, self.lr = alpha, lr
        self.t = 0
        self.rewards = np.zeros(len(initial), np.float64)

    def epsilon(self, t: int) -> float:
        K = len(self.rewards)
        if t == 0 or K == 1:
            return 1.0 / K
        return min(1.0 / K, math.sqrt(math.log(K) / (K * t)))

    def update(self, loss: np.ndarray, weights: np.ndarray) -> np.ndarray:
        K = len(self.rewards)
        seen = ~np.isnan(loss)
        self.rewards[seen] = (self.alpha * self.rewards[seen]
                              + (1 - self.alpha) * loss[seen] / weights[seen])
        self.t += 1
        logits = self.epsilon(self.t - 1) * self.lr * self.rewards
        p = np.exp(logits - logits.max())
        p /= p.sum()
        eps = self.epsilon(self.t)
        return (1 - K * eps) * p + eps

    def state_dict(self) -> dict[str, Any]:
        return {'t': self.t, 'rewards': self.rewards.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t = int(state['t'])
        self.rewards = np.array(state['rewards'], np.float64)


class ADOPolicy(Policy):
    """ADO-style learning progress (Jiang et al. 2025): weights follow how fast each stream's
    smoothed loss falls, times the configured mixture; no progress keeps them (docs/adaptive.md)."""

    def __init__(self, initial: np.ndarray, alpha: float = 0.9, beta: float = 0.5) -> None:
        super().__init__(initial)
        self.alpha, self.beta = alpha, beta
        self.ema = np.full(len(initial), np.nan)

    def update(self, loss: np.ndarray, weights: np.ndarray) -> np.ndarray:
        seen = ~np.isnan(loss)
        fresh = seen & np.isnan(self.ema)
        old = self.ema.copy()
        self.ema[fresh] = loss[fresh]
        both = seen & ~fresh
        self.ema[both] = self.alpha * self.ema[both] + (1 - self.alpha) * loss[both]
        progress = np.where(both, np.maximum(old - self.ema, 0.0), 0.0)
        score = np.nan_to_num(progress) * self.initial
        if score.sum() <= 0:
            return np.asarray(weights, np.float64).copy()
        return self.beta * weights + (1 - self.beta) * score / score.sum()

    def state_dict(self) -> dict[str, Any]:
        return {'ema': [None if math.isnan(x) else float(x) for x in self.ema]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema = np.array([np.nan if x is None else x for x in state['ema']], np.float64)


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


# -------------------------------------------------------------------- the stage, as planned
@dataclass(frozen=True)
class AdaptiveSpec:
    """One adaptive stage as planned, once (:func:`adaptive_spec`, where a bad config is refused):
    segments of ``every`` batches, the starting shares (floored), the policy's options or the
    recorded decisions, and each stream's draws. The run's state lives in its controller."""

    method: str
    names: tuple[str, ...]
    rows: tuple[int, ...]
    initial: tuple[float, ...]
    global_batch: int
    every: int
    warmup: int
    min_share: float
    seed: int
    start_batch: int
    batches: int
    options: dict[str, float] = field(default_factory=dict)
    replay: Optional[tuple[Decision, ...]] = None
    draws: tuple[StreamDraws, ...] = field(default=(), repr=False, compare=False)

    @property
    def segments(self) -> int:
        return -(-self.batches // self.every)

    def segment_of(self, batch: int) -> int:
        return (batch - self.start_batch) // self.every

    def segment_start(self, k: int) -> int:
        return self.start_batch + k * self.every

    def segment_batches(self, k: int) -> int:
        return min(self.every, self.batches - k * self.every)

    def known(self, k: int) -> Optional[np.ndarray]:
        """Segment ``k``'s rows per stream if they are known before the run (replayed, ``fixed``,
        warmup), else None (decided from the loss)."""
        if self.replay is not None:
            return np.asarray(self.replay[k].rows, np.int64)
        if self.method == 'fixed' or self.segment_start(k) < self.start_batch + self.warmup:
            return apportion(self.initial, self.segment_batches(k) * self.global_batch)
        return None


class AdaptiveController:
    """A run's state of one adaptive stage: the policy, every decision, and the per-stream
    cursors that turn one into rows; made per loader from the stage's :class:`AdaptiveSpec`."""

    def __init__(self, spec: AdaptiveSpec) -> None:
        self.spec = spec
        initial = np.array(spec.initial)
        policy = {'odm': ODMPolicy, 'ado': ADOPolicy}.get(spec.method, Policy)
        self.policy: Policy = policy(initial, **spec.options)
        self.decisions: list[Decision] = [self._decision(0, initial, None)]
        self._cursor = (0, np.zeros(len(spec.rows), np.int64))
        self.repeat_warned: dict[str, float] = {}  # stream -> the passes last warned about

    def _decision(self, k: int, weights: np.ndarray, loss: Optional[np.ndarray]) -> Decision:
        s = self.spec
        if s.replay is not None:
            return s.replay[k]
        rows = apportion(weights, s.segment_batches(k) * s.global_batch).tolist()
        lost = None if loss is None else [None if math.isnan(x) else float(x) for x in loss]
        return Decision(s.segment_start(k), [float(w) for w in weights], rows, lost)

    def update(self, loss_sum: np.ndarray, loss_tokens: np.ndarray) -> Decision:
        """The interval that just ended: its per-stream loss (summed over all ranks) -> the
        next segment's decision. Called once per segment boundary, in order."""
        s, k = self.spec, len(self.decisions)
        if k >= s.segments:
            raise AdaptiveError(f'adaptive: all {s.segments} segments are decided')
        loss_sum = np.asarray(loss_sum, np.float64)
        tokens = np.asarray(loss_tokens, np.float64)
        with np.errstate(invalid='ignore', divide='ignore'):
            loss = np.where(tokens > 0, loss_sum / np.maximum(tokens, 1), np.nan)
        weights = self.policy.update(loss, np.array(self.decisions[-1].weights))
        if s.segment_start(k) < s.start_batch + s.warmup:
            weights = np.array(s.initial)
        decision = self._decision(k, floor_shares(weights, s.min_share), loss)
        self.decisions.append(decision)
        return decision

    def decision(self, k: int) -> Decision:
        s = self.spec
        if s.replay is not None:
            while len(self.decisions) <= k:
                self.decisions.append(s.replay[len(self.decisions)])
        if k >= len(self.decisions):
            raise AdaptiveError(
                f'adaptive: segment {k} (batch {s.segment_start(k)}) has no decision: the '
                f'per-stream loss of the segment before was not fed (the trainer\'s adaptive '
                f'callback does so; a loader used alone calls controller.update)')
        return self.decisions[k]

    # -- cursors
    def consumed_before(self, k: int) -> np.ndarray:
        """Rows each stream trained in segments ``0..k-1`` (its cursor at segment ``k``);
        the last answer is kept, so a run's next segment adds one decision's rows."""
        done, cursor = self._cursor
        if done > k:
            done, cursor = 0, np.zeros(len(self.spec.rows), np.int64)
        cursor = cursor + sum((np.asarray(self.decision(j).rows, np.int64) for j in range(done, k)),
                              np.zeros(len(cursor), np.int64))
        self._cursor = (k, cursor)
        return cursor

    def block(self, k: int, start: np.ndarray) -> Block:
        """Segment ``k``: the decided rows per stream from the streams' cursors (``start``: the
        draws earlier stages took), laid out as a stage's block is."""
        return Block(np.asarray(self.decision(k).rows, np.int64), start + self.consumed_before(k),
                     (self.spec.seed, len(self.spec.rows), 1_000_003, k))

    def segment_rows(self, k: int, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Segment ``k``'s (stream, row) in training order: a pass is finished before the next starts."""
        block = self.block(k, start)
        return rows_of(self.spec.draws, *block.draws(0, block.size))

    # -- state
    def state_dict(self) -> dict[str, Any]:
        s = self.spec
        return {'method': s.method, 'streams': list(s.names), 'every': s.every,
                'global_batch': s.global_batch, 'policy': self.policy.state_dict(),
                'decisions': [d.to_dict() for d in self.decisions]}

    def load_state_dict(self, state: dict[str, Any], batch: int) -> None:
        """Restore the policy and the decisions made up to ``batch`` (the resume position):
        a decision for a later segment cannot exist in a consistent checkpoint."""
        s = self.spec
        if list(state['streams']) != list(s.names) or int(state['every']) != s.every \
                or int(state['global_batch']) != s.global_batch:
            raise AdaptiveError(
                f'adaptive: the checkpoint decided segments of {state["every"]} batches of '
                f'{state["global_batch"]} rows over streams {state["streams"]}; this run has '
                f'{s.every} x {s.global_batch} over {list(s.names)}')
        self.policy.load_state_dict(state['policy'])
        self.decisions = [Decision.from_dict(d) for d in state['decisions']]
        self._cursor = (0, np.zeros(len(s.rows), np.int64))

    def report(self) -> dict[str, Any]:
        """``report/mixture.json``'s section of this stage (also what ``replay`` reads)."""
        s = self.spec
        return {**self.state_dict(), 'warmup': s.warmup, 'min_share': s.min_share, 'seed': s.seed,
                'start_batch': s.start_batch, 'batches': s.batches, 'initial': list(s.initial)}


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


def adaptive_spec(config: Any, where: str, stage: str, plan: Plan, draws: Sequence[StreamDraws],
                  start_batch: int, batches: int) -> Optional[AdaptiveSpec]:
    """The stage's :class:`AdaptiveSpec` (None without ``adaptive:``), starting from its
    planned shares; refused here, at plan time, when it cannot be met."""
    a = config.adaptive
    if a is None:
        return None
    where, streams = f'{where}.adaptive', plan.streams
    if a.min_share * len(streams) > 1:
        raise ConfigError(f'{where}.min_share: {a.min_share} x {len(streams)} streams exceeds 1; '
                          f'give at most {1 / len(streams):.4g}')
    replay = tuple(read_replay(a.replay_from, stage, where)) if a.replay_from else None
    options: dict[str, float] = ({'alpha': a.alpha, 'lr': a.lr} if a.method == 'odm' else
                                 {'alpha': a.alpha, 'beta': a.beta} if a.method == 'ado' else {})
    spec = AdaptiveSpec(
        method=a.method, names=tuple(s.name for s in streams), rows=tuple(s.rows for s in streams),
        initial=tuple(floor_shares(np.array([s.share for s in streams]), a.min_share).tolist()),
        global_batch=plan.global_batch_size, every=a.batches('every', where),
        warmup=a.batches('warmup', where), min_share=a.min_share,
        seed=config.shuffle_seed if a.seed is None else a.seed, start_batch=start_batch,
        batches=batches, options=options, replay=replay, draws=tuple(draws))
    want = [(spec.segment_start(k), spec.segment_batches(k) * spec.global_batch) for k in range(spec.segments)]
    got = [(d.batch, sum(d.rows)) for d in replay or ()]
    if replay is not None and (got[:len(want)] != want or len(got) < len(want)
                               or any(len(d.rows) != len(spec.rows) for d in replay)):
        raise ConfigError(
            f'{where}.from: the recorded decisions do not fit this run: they start segments '
            f'at batches {[b for b, _ in got][:5]}... with {[r for _, r in got][:5]}... rows over '
            f'{len(replay[0].rows)} streams; this run needs {len(want)} segments at '
            f'{[b for b, _ in want][:5]}... with {[r for _, r in want][:5]}... rows over '
            f'{len(spec.rows)} streams (same streams, every, batch size and duration)')
    return spec


def adaptive_plan(plan: Plan, c: AdaptiveSpec) -> Plan:
    """An adaptive stage's plan restated as the segments it trains: its rows are exact when every
    segment's are known at plan time (:meth:`AdaptiveSpec.known`), else ``rows_per_stream`` is
    None and the rest have only the ``min_share`` floors."""
    segments = [(k, c.known(k)) for k in range(c.segments)]
    known = sum((r for _, r in segments if r is not None), np.zeros(len(c.names), np.int64))
    undecided = [c.segment_batches(k) * c.global_batch for k, r in segments if r is None]  # rows
    first = next((c.segment_start(k) for k, r in segments if r is None), 0)  # decided during the run
    exact = not undecided
    text = ', '.join(f'{n} {int(r):,}' for n, r in zip(c.names, known))
    if exact:
        how = 'the recorded decisions' if c.replay is not None else 'the configured weights'
        counted = f'adaptive ({c.method}): every segment\'s whole rows from {how}'
    else:
        floors = ', '.join(f'{n} {sum(int(c.min_share * r) for r in undecided):,}' for n in c.names)
        decided = (f'batches {c.start_batch:,}-{first - 1:,} exact at the configured weights ({text}); '
                   f'batches {first:,}-{c.start_batch + c.batches - 1:,} ({sum(undecided):,} rows)'
                   if first > c.start_batch else f'all {sum(undecided):,} rows')
        counted = (f'adaptive ({c.method}): {decided} decided during the run from the per-stream '
                   f'loss, each stream at least {floors}')
    trained = {n: int(r) for n, r in zip(c.names, known)} if exact else None
    passes = {n: r / rows for (n, r), rows in zip(trained.items(), c.rows)} if trained else None
    under = [f'{n}: under one pass: {rows - r:,} of {rows:,} rows are not trained'
             for (n, r), rows in zip((trained or {}).items(), c.rows) if r < rows]
    note = (f'adaptive ({c.method}, every {c.every}ba from batch {c.start_batch + c.warmup:,}, '
            f'min_share {c.min_share}): the table shows the configured start (its per-epoch columns '
            f'are the configured mixture\'s epochs); the stage trains segments of whole rows per stream '
            f'read by per-stream cursors, no row repeated before its stream\'s pass is complete '
            f'(report/mixture.json, docs/adaptive.md)')
    assert plan.duration is not None, 'a stage is planned with its duration'
    return replace(plan, adaptive=True, counted={'run': counted},
                   warnings=plan.warnings + under, notes=plan.notes + [note],
                   duration=replace(plan.duration, rows_per_stream=trained, passes_per_stream=passes))

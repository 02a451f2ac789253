"""Adaptive mixing: policies that set the next interval's weights from the per-stream loss,
the exact rows of each interval, and the per-stream cursors the rows are drawn from.

Pure (numpy only): the loader (:mod:`foundrymix.loader.run_loader`) asks
:class:`AdaptiveController` for each segment's sample ids, the trainer's callback
(:mod:`foundrymix.train.callbacks.adaptive`) feeds it the all-reduced per-stream loss at
each segment boundary. Why this split: a decision must be identical on every rank and on
a resumed run, so it is a function of (state, summed loss) only, and the state is a few
plain lists (checkpoint and ``report/mixture.json``). See docs/adaptive.md.

A segment is a block of the order (:mod:`foundrymix.plan.order`) whose per-stream counts
the policy decided: each stream's draws go on from its cursor (a fresh permutation per
pass), so no row repeats before every row of its stream was trained once, across any
number of weight changes.

Length (over ~300 lines): the policies, the decision record, the controller (segments,
cursors, state) and the replay reader share one state format, kept in one module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from foundrymix.plan.exact import stratified_portions
from foundrymix.plan.order import WINDOW_ROWS, Block, StreamDraws, rows_of, stream_draws

#: ``adaptive.lr`` default of ODM: the bandit's reward scale (the paper's EXP3 has none; its
#: rewards are losses of ~2-10 nats, ours too, so 1.0 keeps its update)
ODM_DEFAULT_LR = 1.0


def whole_rows(weights: Sequence[float], rows: int) -> list[int]:
    """``rows`` split by ``weights`` into whole rows per stream, as streaming's stratified
    batching splits a batch (``int(w x rows)``, the rest to the largest remainders)."""
    return stratified_portions([float(w) for w in weights], rows)


def floor_shares(weights: np.ndarray, min_share: float) -> np.ndarray:
    """``weights`` normalized, with every share raised to at least ``min_share`` (needs
    ``min_share x n <= 1``): the streams below it get exactly ``min_share``, the others
    share the rest in their proportions (weights already above the floor are unchanged)."""
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


# ------------------------------------------------------------------------- policies
class Policy:
    """Maps the last interval's per-stream mean loss to the next interval's weights.

    ``loss`` holds NaN for a stream with no loss tokens in the interval. State is plain
    floats (:meth:`state_dict`), restored bitwise by :meth:`load_state_dict`.
    """

    def __init__(self, initial: np.ndarray) -> None:
        self.initial = np.asarray(initial, np.float64)

    def update(self, loss: np.ndarray, weights: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class FixedPolicy(Policy):
    """The configured weights throughout: the baseline an adaptive run is compared with."""

    def update(self, loss: np.ndarray, weights: np.ndarray) -> np.ndarray:
        return self.initial.copy()


class ODMPolicy(Policy):
    """ODM (Albalak et al. 2023, "Efficient Online Data Mixing For Language Model
    Pre-Training"): EXP3 over streams, rewarded by training loss.

    Per update ``t`` (1-based), with K streams and the weights ``pi`` the interval trained:

    * exploration ``eps_t = min(1/K, sqrt(ln K / (K t)))`` (``eps_0 = 1/K``);
    * reward estimate, for each stream with loss tokens in the interval:
      ``R_i <- alpha R_i + (1 - alpha) L_i / pi_i`` (the paper's importance-weighted moving
      average; ``L_i`` the stream's mean loss per loss token);
    * ``pi_i = (1 - K eps_t) softmax(eps_{t-1} lr R)_i + eps_t``.

    Simplified from the paper: it samples one stream per batch and observes that stream's
    loss only; a mixed interval observes every stream, so every stream's estimate is
    updated each time (still importance-weighted, as the paper's estimator is).
    """

    def __init__(self, initial: np.ndarray, alpha: float = 0.9, lr: float = ODM_DEFAULT_LR) -> None:
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
    """ADO-style learning progress: weight streams by how fast their loss is falling.

    ADO (Jiang et al. 2025, "Adaptive Data Optimization") fits a power law
    ``L_i(n) = e_i + b_i n^-a_i`` per stream and weights by the fitted derivative times a
    prior. Simplified here: the derivative is measured, not fitted -- each stream's loss
    is smoothed (EMA, ``alpha``), its progress is the drop of the smoothed loss over the
    last interval (>= 0), and the next weights are ``beta x previous + (1 - beta) x
    normalized(progress x prior)``, where the prior is the configured mixture. A stream
    whose loss does not fall (random tokens: already at its entropy) loses weight down
    to ``min_share``; without any progress the weights stay where they are.
    """

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
    """One adaptive stage: segments of ``every`` batches, the policy, every decision, and the
    per-stream cursors that turn a decision into sample ids.

    ``rows``: underlying rows per stream (config order); ``offsets``: each stream's first
    global sample id (streaming numbers samples stream by stream). ``start_batch``: the
    stage's first global batch; ``batches``: its length. ``replay``: recorded decisions
    (``method: replay``), used instead of the policy.
    """

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
    #: each stream's draws (:func:`~foundrymix.plan.order.stream_draws`); None: one shard a stream
    draws: Optional[list[StreamDraws]] = None

    def __post_init__(self) -> None:
        initial = floor_shares(np.array(self.initial), self.min_share)
        self.initial = initial.tolist()
        if self.method == 'odm':
            self.policy: Policy = ODMPolicy(initial, **self.options)
        elif self.method == 'ado':
            self.policy = ADOPolicy(initial, **self.options)
        else:
            self.policy = FixedPolicy(initial)
        self.offsets = np.concatenate([[0], np.cumsum(self.rows)[:-1]]).astype(np.int64)
        if self.draws is None:
            self.draws = [StreamDraws([n], (self.seed, i)) for i, n in enumerate(self.rows)]
        if self.replay is not None:
            self._check_replay()
        if not self.decisions:
            self.decisions.append(self._decision(0, initial, None))

    def _check_replay(self) -> None:
        from foundrymix.config import ConfigError
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
        """The segment (0-based) of global batch ``batch``."""
        return (batch - self.start_batch) // self.every

    def segment_start(self, k: int) -> int:
        return self.start_batch + k * self.every

    def segment_batches(self, k: int) -> int:
        return min(self.every, self.batches - k * self.every)

    def _decision(self, k: int, weights: np.ndarray, loss: Optional[np.ndarray]) -> Decision:
        if self.replay is not None:
            return self.replay[k]
        rows = whole_rows(weights, self.segment_batches(k) * self.global_batch)
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
        """Segment ``k``'s global sample ids, in training order (global batch after global
        batch): a block of the decided rows per stream from the streams' cursors, so even a
        segment that crosses a stream's pass boundary trains the rest of the old pass before
        any row of the new one."""
        decision = self.decision(k)
        block = Block(np.asarray(decision.rows, np.int64), self.consumed_before(k),
                      (self.seed, len(self.rows), 1_000_003, k))
        assert self.draws is not None
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
    import json

    from foundrymix.config import ConfigError
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
    """The controller of a planned stage (a :class:`~foundrymix.plan.stages.StagePlan`) whose
    config is adaptive, else None. Its initial weights are the stage's planned shares (the
    configured mixture); refused here -- at plan time -- when it cannot be met."""
    from foundrymix.config import ConfigError
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
        draws=stream_draws([i.shard_rows for i in stage.infos], [s.name for s in streams],
                           seed, stage.name, config.shuffle_block_size or WINDOW_ROWS,
                           config.shuffle) if stage.infos else None)

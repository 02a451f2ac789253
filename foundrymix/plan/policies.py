"""Adaptive mixing's policies: each maps the last interval's per-stream mean loss to the next
interval's weights (:class:`~foundrymix.plan.adaptive.AdaptiveController` runs them).

A decision must be identical on every rank and on a resumed run, so a policy is a function of
its state and the summed loss only, and its state is plain floats (checkpoint and
``report/mixture.json``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

#: ``adaptive.lr`` default of ODM: the bandit's reward scale (the paper's EXP3 has none; its
#: rewards are losses of ~2-10 nats, ours too, so 1.0 keeps its update)
ODM_DEFAULT_LR = 1.0



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

"""Adaptive mixing's policies: each maps the last interval's per-stream mean loss to the next
interval's weights. A decision must be identical on every rank and on a resumed run, so a policy
is a function of its state and the summed loss only, and its state is plain floats."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

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

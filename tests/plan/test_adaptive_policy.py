"""The adaptive policies against hand-computed updates (pure numpy, no data)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from foundrymix.plan.adaptive import ADOPolicy, ODMPolicy, floor_shares
from foundrymix.plan.exact import apportion


def test_odm_is_exp3_with_the_papers_exploration_schedule():
    """Two streams, alpha 0.9, losses 2.0 and 1.0 on an even mix, twice, by hand:

    update 1: R = 0.1 x [2/0.5, 1/0.5] = [0.4, 0.2]; eps_1 = min(1/2, sqrt(ln 2 / 2)) = 1/2,
    so (1 - K eps_1) = 0: the even mix. update 2: R = 0.9 R + 0.1 x [4, 2] = [0.76, 0.38];
    logits eps_1 x R = [0.38, 0.19]; eps_2 = sqrt(ln 2 / 4).
    """
    odm = ODMPolicy(np.array([0.5, 0.5]), alpha=0.9, lr=1.0)
    first = odm.update(np.array([2.0, 1.0]), np.array([0.5, 0.5]))
    assert first.tolist() == [0.5, 0.5]
    assert odm.rewards.tolist() == pytest.approx([0.4, 0.2], abs=1e-15)
    second = odm.update(np.array([2.0, 1.0]), np.array([0.5, 0.5]))
    e = math.sqrt(math.log(2) / 4)
    p0 = math.exp(0.38) / (math.exp(0.38) + math.exp(0.19))
    want = [(1 - 2 * e) * p0 + e, (1 - 2 * e) * (1 - p0) + e]
    assert second.tolist() == pytest.approx(want, abs=1e-12)
    assert second[0] > second[1]  # ODM rewards the stream with the higher loss


def test_odm_importance_weights_the_reward_by_the_share_trained():
    """Equal losses on a 0.8/0.2 mix: the rarely trained stream's reward is 4x larger."""
    odm = ODMPolicy(np.array([0.8, 0.2]), alpha=0.5)
    odm.update(np.array([3.0, 3.0]), np.array([0.8, 0.2]))
    assert odm.rewards.tolist() == pytest.approx([0.5 * 3 / 0.8, 0.5 * 3 / 0.2], abs=1e-15)


def test_odm_state_restores_bitwise():
    a = ODMPolicy(np.array([0.3, 0.3, 0.4]))
    losses = [np.array([2.1, 3.3, np.nan]), np.array([1.7, 2.9, 4.4]), np.array([1.1, 2.2, 3.3])]
    w = np.array([0.3, 0.3, 0.4])
    for loss in losses[:2]:
        w = a.update(loss, w)
    b = ODMPolicy(np.array([0.3, 0.3, 0.4]))
    b.load_state_dict(a.state_dict())
    assert a.update(losses[2], w).tolist() == b.update(losses[2], w).tolist()


def test_ado_moves_weight_to_the_stream_whose_loss_falls():
    """EMA alpha 0.5, beta 0.5: stream 0 falls 4 -> 2 (EMA 4 -> 3), stream 1 stays at 3."""
    ado = ADOPolicy(np.array([0.5, 0.5]), alpha=0.5, beta=0.5)
    w = np.array([0.5, 0.5])
    assert ado.update(np.array([4.0, 3.0]), w).tolist() == [0.5, 0.5]  # first sight: no progress yet
    # progress [1, 0] x prior [0.5, 0.5] -> target [1, 0]; 0.5 x [0.5, 0.5] + 0.5 x [1, 0]
    assert ado.update(np.array([2.0, 3.0]), w).tolist() == [0.75, 0.25]
    # no progress at all: the weights stay
    flat = ADOPolicy(np.array([0.5, 0.5]), alpha=0.5)
    flat.update(np.array([3.0, 3.0]), w)
    assert flat.update(np.array([3.5, 3.0]), np.array([0.6, 0.4])).tolist() == [0.6, 0.4]


def test_floor_and_whole_rows():
    assert floor_shares(np.array([0.5, 0.3, 0.2]), 0.05).tolist() == pytest.approx([0.5, 0.3, 0.2])
    out = floor_shares(np.array([0.99, 0.01, 0.0]), 0.1)
    assert out.tolist() == pytest.approx([0.8, 0.1, 0.1])
    assert apportion([0.5, 0.3, 0.2], 24).tolist() == [12, 7, 5]  # 7.2 and 4.8: the remainder to dolly
    assert sum(apportion([1 / 3] * 3, 100)) == 100

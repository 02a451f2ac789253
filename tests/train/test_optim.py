"""``optimizer.name: decoupled_lionw`` (LLM-Foundry's Lion): the update rule, recomputed with numpy
from the paper's formula, across an LR schedule with decoupled weight decay; and a run builds it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_run_config

from foundrymix.train.config import TrainConfig
from foundrymix.train.optim import DecoupledLionW


def _lion_reference(p, grads, lrs, initial_lr, betas, wd):
    """Lion (Chen et al. 2023) with Foundry's decoupled, schedule-scaled weight decay, in float64."""
    p, m = p.astype(np.float64), np.zeros_like(p, dtype=np.float64)
    b1, b2 = betas
    for g, lr in zip(grads, lrs):
        p = p * (1 - lr / initial_lr * wd)
        p = p - lr * np.sign(b1 * m + (1 - b1) * g)
        m = b2 * m + (1 - b2) * g
    return p, m


@pytest.mark.parametrize('wd', [0.0, 0.1])
def test_lion_steps_equal_the_rule(wd):
    rng = np.random.default_rng(0)
    p0 = rng.normal(size=(5, 3))
    grads = [rng.normal(size=(5, 3)) for _ in range(6)]
    lrs = [1e-2, 8e-3, 6e-3, 4e-3, 2e-3, 1e-3]  # a schedule changes group['lr'] between steps
    param = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float64))
    opt = DecoupledLionW([param], lr=lrs[0], betas=(0.9, 0.99), weight_decay=wd)
    for g, lr in zip(grads, lrs):
        opt.param_groups[0]['lr'] = lr
        param.grad = torch.tensor(g)
        opt.step()
    p, m = _lion_reference(p0, grads, lrs, lrs[0], (0.9, 0.99), wd)
    np.testing.assert_allclose(param.detach().numpy(), p, rtol=0, atol=1e-12)
    np.testing.assert_allclose(opt.state[param]['exp_avg'].numpy(), m, rtol=0, atol=1e-12)
    assert not np.allclose(p, p0)


def test_config_builds_lion_with_foundrys_default_betas():
    from foundrymix.train.optim import build_optimizer as _optimizer

    model = torch.nn.Linear(2, 2)
    cfg = TrainConfig.from_dict(tiny_run_config({'streams': {'a': {'local': '/x'}}}, global_train_batch_size=2,
                                                max_duration='1ba', optimizer={'name': 'decoupled_lionw', 'lr': 1e-4,
                                                                               'weight_decay': 1e-5}))
    opt = _optimizer(cfg, model)
    assert isinstance(opt, DecoupledLionW)
    assert opt.param_groups[0]['betas'] == (0.9, 0.99) and opt.param_groups[0]['weight_decay'] == 1e-5
    adamw = _optimizer(TrainConfig.from_dict(tiny_run_config({'streams': {'a': {'local': '/x'}}},
                                                             global_train_batch_size=2, max_duration='1ba')), model)
    assert adamw.param_groups[0]['betas'] == (0.9, 0.95)  # unchanged for the AdamW kinds

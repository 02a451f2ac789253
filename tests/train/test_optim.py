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


def _train(opt_cls, steps=12, **kw):
    """A small model trained ``steps`` steps on fixed data under a cosine LR schedule."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = opt_cls(model.parameters(), **kw)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
    return model, opt


@pytest.mark.parametrize('weight_decay', [0.0, 1e-2])
def test_fused_decoupled_adamw_equals_composers_rule(weight_decay):
    """The fused kernel trains what Composer's DecoupledAdamW (its own per-tensor loop) trains,
    weight decay scaled by the schedule included, up to float rounding; and its state loads into
    Composer's class (the same group keys and state)."""
    from composer.optim import DecoupledAdamW

    from foundrymix.train.optim import FusedDecoupledAdamW

    kw = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    ref, ref_opt = _train(DecoupledAdamW, **kw)
    got, got_opt = _train(FusedDecoupledAdamW, **kw)
    for a, b in zip(ref.parameters(), got.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # the decay is applied: with it the weights differ from a run without it by far more than rounding
    if weight_decay:
        plain, _ = _train(FusedDecoupledAdamW, **{**kw, 'weight_decay': 0.0})
        assert max((a - b).abs().max().item() for a, b in zip(got.parameters(), plain.parameters())) > 1e-4
    assert got_opt.param_groups[0]['weight_decay'] == weight_decay  # Composer's meaning, kept in the state
    assert got_opt.param_groups[0]['initial_lr'] == ref_opt.param_groups[0]['initial_lr'] == 3e-2
    back = DecoupledAdamW(ref.parameters(), **kw)
    back.load_state_dict(got_opt.state_dict())
    assert set(back.state_dict()['state'][0]) == set(ref_opt.state_dict()['state'][0])


def test_config_picks_the_fused_kernel_on_a_gpu_and_composers_loop_on_cpu():
    from composer.optim import DecoupledAdamW

    from foundrymix.train.optim import FusedDecoupledAdamW, build_optimizer

    model = torch.nn.Linear(2, 2)

    def cfg(**opt):
        return TrainConfig.from_dict(tiny_run_config({'streams': {'a': {'local': '/x'}}}, global_train_batch_size=2,
                                                     max_duration='1ba', optimizer=opt))
    assert type(build_optimizer(cfg(), model, 'cpu')) is DecoupledAdamW
    assert type(build_optimizer(cfg(), model, 'gpu')) is FusedDecoupledAdamW
    assert type(build_optimizer(cfg(fused=True), model, 'cpu')) is FusedDecoupledAdamW
    assert type(build_optimizer(cfg(fused=False), model, 'gpu')) is DecoupledAdamW
    adamw = build_optimizer(cfg(name='adamw'), model, 'gpu')
    assert type(adamw) is torch.optim.AdamW and adamw.defaults['fused'] is True
    assert not build_optimizer(cfg(name='adamw'), model, 'cpu').defaults['fused']

"""The optimizers: LLM-Foundry's Lion (``decoupled_lionw``: Composer has none, and Foundry's comes
with all of Foundry; its per-parameter norm metrics are not reproduced) and Composer's decoupled
AdamW rule on torch's fused kernel (``decoupled_adamw`` on a GPU).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

#: LLM-Foundry's DecoupledLionW defaults
LION_BETAS = (0.9, 0.99)


class DecoupledLionW(torch.optim.Optimizer):
    """Lion (Chen et al. 2023) with weight decay decoupled from the gradient and scaled by the LR
    schedule, ``p *= 1 - (lr / initial_lr) * wd`` (``initial_lr``: the group's lr when the optimizer
    was built); Foundry's defaults, ``betas=(0.9, 0.99)`` and no ``eps``."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = LION_BETAS,
                 weight_decay: float = 0.0) -> None:
        if lr <= 0:
            raise ValueError(f'Invalid LR: {lr}. LR must be > 0')
        if not all(0.0 <= b <= 1.0 for b in betas):
            raise ValueError(f'Invalid beta values: {betas}; all betas must be between 0 and 1')
        super().__init__(params, {'lr': lr, 'betas': tuple(betas), 'weight_decay': weight_decay})
        for group in self.param_groups:
            group['initial_lr'] = group['lr']

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, initial = group['lr'], group['weight_decay'], group['initial_lr']
            beta1, beta2 = group['betas']
            for p in group['params']:
                if p.grad is None or not p.requires_grad:
                    continue
                state = self.state[p]
                if not state:
                    state['exp_avg'] = torch.zeros_like(p)
                m = state['exp_avg']
                if wd:
                    p.mul_(1 - (lr / initial if initial else 1.0) * wd)
                p.add_(m.lerp(p.grad, 1 - beta1).sign_(), alpha=-lr)
                m.lerp_(p.grad, 1 - beta2)
        return loss


class FusedDecoupledAdamW(torch.optim.AdamW):
    """Composer's ``DecoupledAdamW`` rule -- ``p *= 1 - (lr / initial_lr) * wd``, then Adam's step -- on
    torch's fused AdamW kernel (no host sync per tensor), equal to Composer's up to float rounding: ``step``
    hands torch ``wd / initial_lr``, the group keeps Composer's ``weight_decay`` and ``initial_lr`` (its
    checkpoints load into either class)."""

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float) -> None:
        if lr <= 0:
            raise ValueError(f'Invalid LR: {lr}. LR must be > 0')
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         fused=True)
        for group in self.param_groups:
            group['initial_lr'] = group['lr']

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        decays = [group['weight_decay'] for group in self.param_groups]
        for group in self.param_groups:
            group['weight_decay'] = group['weight_decay'] / group['initial_lr']
        try:
            return super().step(closure)
        finally:
            for group, decay in zip(self.param_groups, decays):
                group['weight_decay'] = decay


def build_optimizer(cfg: Any, model: torch.nn.Module, device: str = 'cpu') -> torch.optim.Optimizer:
    """The optimizer over the parameters that train (a LoRA run's frozen base is not in it:
    no state kept for it, and no weight decay can reach it). ``fused`` (default: on a GPU) takes
    torch's fused AdamW kernel; Composer's per-tensor loop stays the CPU default, so CPU runs
    keep their exact figures."""
    o = cfg.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    if o.name == 'decoupled_lionw':
        return DecoupledLionW(params, lr=o.lr, betas=o.betas or LION_BETAS, weight_decay=o.weight_decay)
    betas = o.betas or (0.9, 0.95)
    fused = device == 'gpu' if o.fused is None else o.fused
    if o.name == 'adamw':
        return torch.optim.AdamW(params, lr=o.lr, betas=betas, eps=o.eps, weight_decay=o.weight_decay,
                                 fused=fused or None)
    if fused:
        return FusedDecoupledAdamW(params, lr=o.lr, betas=betas, eps=o.eps, weight_decay=o.weight_decay)
    from composer.optim import DecoupledAdamW
    return DecoupledAdamW(params, lr=o.lr, betas=betas, eps=o.eps, weight_decay=o.weight_decay)

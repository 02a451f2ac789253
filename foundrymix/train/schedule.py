"""The ``wsd`` schedule as a Composer scheduler: :class:`WSDScheduler`.

Composer steps a scheduler at the end of batch ``b`` *before* advancing the timestamp, so a call
in training sets batch ``b + 1``'s LR (the call before training, ``state.batch`` None, batch 0's);
it returns the multiplier of the batch it sets: every batch trains at what ``plan`` prints.
:func:`apply_resume_lr` sets a resume batch's LR under this run's schedule, not the checkpoint's.
"""

from __future__ import annotations

from typing import Any, Optional

from foundrymix.train.lr_schedule import Timeline, WSDSchedule, resolve_wsd


class WSDScheduler:
    """A Composer scheduler (``callable(state) -> LR multiplier``) over a resolved schedule."""

    def __init__(self, schedule: WSDSchedule) -> None:
        self.schedule = schedule

    @classmethod
    def of(cls, cfg: Any, run: Any) -> 'WSDScheduler':
        """From the ``scheduler`` config and the run's plan (the spans resolved once)."""
        s = cfg.scheduler
        return cls(resolve_wsd(s.warmup, s.decay, Timeline.of(run)))

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        if ssr != 1.0:
            raise ValueError('scheduler wsd does not support scale_schedule_ratio')
        batch = int(state.timestamp.batch)
        training = state.batch is not None  # a step after batch b sets batch b + 1's LR
        return self.schedule.multiplier(batch + 1 if training else batch)

    def __repr__(self) -> str:
        return f'WSDScheduler({self.schedule})'


def apply_resume_lr(state: Any, scheduler: WSDScheduler) -> None:
    """Set the resume batch's LR under this run's schedule (see the module docstring)."""
    batch = int(state.timestamp.batch)
    for compiled in state.schedulers:
        for group, base in zip(compiled.optimizer.param_groups, compiled.base_lrs):
            group['lr'] = base * scheduler.schedule.multiplier(batch)


def build_scheduler(cfg: Any, run: Any, t_warmup: Optional[str] = None) -> Any:
    """The config's Composer scheduler; ``t_warmup``: the config's, in the unit Composer runs in
    (:func:`foundrymix.train.preflight.warmup_in_samples`)."""
    from composer.optim import (ConstantWithWarmupScheduler, CosineAnnealingWithWarmupScheduler,
                                LinearWithWarmupScheduler)
    s = cfg.scheduler
    if s.name == 'wsd':
        return WSDScheduler.of(cfg, run)
    t_warmup = t_warmup or s.t_warmup
    if s.name == 'cosine_with_warmup':
        return CosineAnnealingWithWarmupScheduler(t_warmup=t_warmup, alpha_f=s.alpha_f)
    if s.name == 'linear_decay_with_warmup':
        return LinearWithWarmupScheduler(t_warmup=t_warmup, alpha_f=s.alpha_f)
    return ConstantWithWarmupScheduler(t_warmup=t_warmup)

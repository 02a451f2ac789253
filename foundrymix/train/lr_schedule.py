"""The warmup-stable-decay LR schedule (``scheduler: {name: wsd, ...}``) as arithmetic over global
batches, resolved against the run's stages, and the run's Composer scheduler. Imports no Composer or
torch (:func:`build_scheduler` defers Composer's): ``foundrymix plan`` and the trainer both evaluate
:meth:`WSDSchedule.multiplier`, so the run trains at the LR the plan printed. A batch's LR is the
schedule at its *end* (formulas: docs/schedules.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence

from foundrymix.config import (SPAN_UNITS, ConfigError, Gather, did_you_mean, parse_time, read_dataclass,
                               to_batches)


@dataclass
class Span:
    """A part of the run: a duration (``20ba``, ``10%``, ...) or a stage (``{stage: anneal}``)."""

    duration: Optional[str] = None
    stage: Optional[str] = None

    def check(self, where: str) -> None:
        if (self.duration is None) == (self.stage is None):
            raise ConfigError(f'{where}: give exactly one of duration (e.g. 20ba, 10%) or stage '
                              f'(a stage name)')
        if self.duration is not None:
            parse_time(self.duration, f'{where}.duration', SPAN_UNITS, positive=True)

    @classmethod
    def from_config(cls, value: Any, where: str) -> 'Span':
        if isinstance(value, str):  # ``warmup: 10ba``
            span = cls(duration=value)
            span.check(where)
            return span
        return read_dataclass(cls, value, where)

    def text(self) -> str:
        return f'stage {self.stage}' if self.stage is not None else str(self.duration)


@dataclass
class Decay(Span):
    """``decay: {stage: anneal | duration: 20ba, to: 0.0, shape: linear|cosine|sqrt}``: the
    decay's span, the LR it ends at (a fraction of ``lr``) and its shape."""

    to: float = 0.0
    shape: Literal['linear', 'cosine', 'sqrt'] = 'linear'
    from_config = classmethod(read_dataclass)  # a mapping only (a bare duration is a warmup's)

    def check(self, where: str) -> None:
        super().check(where)
        if not 0.0 <= self.to <= 1.0:
            raise ConfigError(f'{where}.to: {self.to} is not a fraction of lr in [0, 1]')


def check_stage_names(spans: Sequence[tuple[str, Optional[Span]]], stages: Sequence[str],
                      explicit: bool) -> None:
    """Every ``{stage: X}`` must name a stage of the run (all unknown ones at once)."""
    gather = Gather()
    for where, span in spans:
        if span is None or span.stage is None or span.stage in stages:
            continue
        listing = ', '.join(stages) if explicit else f'{stages[0]} (the run has no stages:)'
        gather.add(ConfigError(f'{where}.stage: no stage {span.stage!r}; the stages are: '
                               f'{listing}{did_you_mean(span.stage, list(stages))}'))
    gather.raise_any()


def span_batches(run: Any, text: str, where: str) -> int:
    """A span duration as whole global batches of ``run`` (a RunPlan); refused with the numbers."""
    time = parse_time(text, where, SPAN_UNITS, positive=True)
    per_epoch = None if run.explicit else run.stages[0].plan.batches_per_epoch
    if time.unit == 'ep' and per_epoch is None:
        raise ConfigError(f'{where}: {text} is ambiguous with stages (epochs of which stage?); '
                          f'give it in batches (ba), as a fraction of the run (0.1dur, 10%) or '
                          f'as a stage ({{stage: NAME}})')
    if time.unit in ('sp', 'tok') and run.batch_varies:
        # wsd counts global batches; with per-stage batches samples are no fixed number of them
        raise ConfigError(f'{where}: {text} is not a fixed number of global batches: the stages\' '
                          f'global batches differ ({", ".join(map(str, run.batch_sizes))} rows); '
                          f'give it as a stage ({{stage: NAME}}) or in batches (ba)')
    G = run.global_batch_size
    return to_batches(time, where, batches_per_epoch=per_epoch, samples_per_batch=G,
                      tokens_per_batch=G * run.max_seq_len, total_batches=run.total_batches)


def stage_span(run: Any, name: str) -> tuple[int, int]:
    """(first batch, one past the last) of ``run``'s stage ``name`` (:func:`check_stage_names` refused
    an unknown name when the config was read)."""
    stage = next(s for s in run.stages if s.name == name)
    return stage.start_batch, stage.start_batch + stage.batches


@dataclass
class WSDSchedule:
    """A warmup-stable-decay schedule resolved to batches: the LR multiplier of every batch, and the
    run's Composer scheduler (``callable(state) -> LR multiplier``).

    Composer steps a scheduler at the end of batch ``b`` *before* advancing the timestamp, so a call
    in training sets batch ``b + 1``'s LR (the call before training, ``state.batch`` None, batch 0's):
    every batch trains at what ``plan`` prints."""

    warmup: int             # batches 0 .. warmup-1 warm up
    decay_start: int        # first batch of the decay
    decay_end: int          # one past its last batch
    to: float
    shape: str
    total_batches: int
    stage_starts: list[tuple[str, int]] = field(default_factory=list)  # for the printout

    def multiplier(self, batch: int) -> float:
        """The LR of global batch ``batch`` (0-based) over ``lr``: the schedule at its end."""
        t = batch + 1
        if t <= self.warmup:
            return t / self.warmup
        if t <= self.decay_start:
            return 1.0
        if t >= self.decay_end:
            return self.to
        p = (t - self.decay_start) / (self.decay_end - self.decay_start)
        if self.shape == 'cosine':
            return self.to + (1 - self.to) * (1 + math.cos(math.pi * p)) / 2
        if self.shape == 'sqrt':
            return 1 - (1 - self.to) * math.sqrt(p)
        return 1 - (1 - self.to) * p

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        if ssr != 1.0:
            raise ValueError('scheduler wsd does not support scale_schedule_ratio')
        batch = int(state.timestamp.batch)
        training = state.batch is not None  # a step after batch b sets batch b + 1's LR
        return self.multiplier(batch + 1 if training else batch)

    def apply_resume_lr(self, state: Any) -> None:
        """Set the resume batch's LR under this run's schedule, not the checkpoint's."""
        batch = int(state.timestamp.batch)
        for compiled in state.schedulers:
            for group, base in zip(compiled.optimizer.param_groups, compiled.base_lrs):
                group['lr'] = base * self.multiplier(batch)

    def phases(self) -> list[tuple[str, int, int]]:
        """(phase, first batch, one past the last) of warmup, stable, decay and after, if any."""
        spans = [('warmup', 0, self.warmup), ('stable', self.warmup, self.decay_start),
                 ('decay', self.decay_start, self.decay_end),
                 ('after decay', self.decay_end, self.total_batches)]
        return [p for p in spans if p[2] > p[1]]

    def lrs(self, lr: float) -> list[float]:
        """The LR of every batch of the run."""
        return [lr * self.multiplier(b) for b in range(self.total_batches)]

    def to_dict(self, lr: float) -> dict[str, Any]:
        """The spans and the LR (``lr`` times the multiplier) where it changes course."""
        return {'name': 'wsd', 'lr': lr, 'warmup_batches': self.warmup,
                'decay_start': self.decay_start, 'decay_end': self.decay_end, 'to': self.to,
                'shape': self.shape,
                'phases': [{'phase': n, 'first_batch': a, 'last_batch': b - 1,
                            'lr_first': lr * self.multiplier(a), 'lr_last': lr * self.multiplier(b - 1)}
                           for n, a, b in self.phases()],
                'stages': [{'stage': n, 'first_batch': b, 'lr': lr * self.multiplier(b)}
                           for n, b in self.stage_starts]}


def resolve_wsd(cfg: Any, run: Any) -> WSDSchedule:
    """The ``scheduler`` config's spans in batches of ``run`` (a RunPlan; every problem at once): the
    warmup from batch 0 (a stage: to its end), the decay to the run's end (a duration) or over the
    named stage."""
    warmup, decay = cfg.scheduler.warmup, cfg.scheduler.decay
    gather, where = Gather(), 'scheduler'
    W, start, end = 0, run.total_batches, run.total_batches
    if warmup is not None:
        with gather:
            W = (stage_span(run, warmup.stage)[1] if warmup.stage is not None
                 else span_batches(run, str(warmup.duration), f'{where}.warmup'))
    with gather:
        if decay.stage is not None:
            start, end = stage_span(run, decay.stage)
        else:
            start = end - span_batches(run, str(decay.duration), f'{where}.decay.duration')
    gather.raise_any()
    if start < 0:
        raise ConfigError(f'{where}.decay.duration: {decay.duration} is {end - start} batches, longer '
                          f'than the run ({run.total_batches} batches)')
    if W > start:
        raise ConfigError(f'{where}.warmup: {warmup.text() if warmup else W} ends at batch {W}, '
                          f'after the decay starts (batch {start}); shorten the warmup or start '
                          f'the decay later')
    return WSDSchedule(warmup=W, decay_start=start, decay_end=end, to=decay.to, shape=decay.shape,
                       total_batches=run.total_batches, stage_starts=[(s.name, s.start_batch) for s in run.stages])


def build_scheduler(cfg: Any, run: Any, t_warmup: Optional[str] = None) -> Any:
    """The config's Composer scheduler (``wsd``: the :class:`WSDSchedule`); ``t_warmup``: the config's,
    in the unit Composer runs in (:func:`foundrymix.train.preflight.composer_warmup`)."""
    from composer.optim import (ConstantWithWarmupScheduler, CosineAnnealingWithWarmupScheduler,
                                LinearWithWarmupScheduler)
    s = cfg.scheduler
    if s.name == 'wsd':
        return resolve_wsd(cfg, run)
    t_warmup = t_warmup or s.t_warmup
    if s.name == 'cosine_with_warmup':
        return CosineAnnealingWithWarmupScheduler(t_warmup=t_warmup, alpha_f=s.alpha_f)
    if s.name == 'linear_decay_with_warmup':
        return LinearWithWarmupScheduler(t_warmup=t_warmup, alpha_f=s.alpha_f)
    return ConstantWithWarmupScheduler(t_warmup=t_warmup)

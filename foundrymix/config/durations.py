"""Durations and intervals: one parser for every time a config gives (``100ba``, ``5000sp``,
``1000000tok``, ``3ep``, ``0.1dur``, ``10%``) and one rule turning a duration into global batches.

A plan, a stage switch, an LR schedule and the trainer read one string as the same batch; values
are exact fractions of their text (``0.1dur`` is 1/10), so "whole batches" is never a tolerance.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Optional, Sequence

from foundrymix.errors import ConfigError
from foundrymix.config.reader import read_value

#: unit -> what it counts (``dur`` and ``%``: a fraction and a percentage of the run)
UNIT_WORDS = {'ba': 'batches', 'sp': 'samples', 'tok': 'tokens', 'ep': 'epochs'}
#: a run's length or a stage's: whole epochs, batches, samples or tokens
DURATION_UNITS = ('ep', 'ba', 'sp', 'tok')
#: how often something happens (``eval_interval``, ``t_warmup``, ...): a length or a fraction of the run
INTERVAL_UNITS = ('ba', 'sp', 'tok', 'ep', 'dur')
#: a part of the run (an LR schedule's warmup or decay)
SPAN_UNITS = ('ba', 'sp', 'tok', 'ep', 'dur', '%')
_EXAMPLES = {'ep': '3ep', 'ba': '100ba', 'sp': '5000sp', 'tok': '1000000tok', 'dur': '0.1dur', '%': '10%'}
_WHOLE = ('ba', 'sp', 'tok', 'ep')
_TIME = re.compile(r'\s*(\d+(?:\.\d*)?|\.\d+)\s*(ba|sp|tok|ep|dur|%)?\s*')


@dataclass(frozen=True)
class Time:
    """A parsed duration: its exact value, its unit and the text it was read from."""

    value: Fraction
    unit: str
    text: str


def _listing(units: Sequence[str]) -> str:
    return ', '.join(units[:-1]) + f' or {units[-1]}' if len(units) > 1 else units[0]


def parse_time(text: Any, where: str, units: Sequence[str] = SPAN_UNITS, positive: bool = False) -> Time:
    """``text`` as a :class:`Time` in one of ``units``; a one-line :class:`ConfigError` naming
    ``where`` otherwise: no unit (``10`` could be epochs or batches), another unit, a fraction of
    a whole unit (``1.5ba``), more than the whole run (``2dur``), or zero when ``positive``."""
    m = _TIME.fullmatch(str(text))
    if m is None or (m.group(2) is not None and m.group(2) not in units):
        raise ConfigError(f'{where}: {text!r} is not a duration: a number and its unit, '
                          f'{_listing(units)} (e.g. {", ".join(_EXAMPLES[u] for u in units)})')
    number, unit = m.group(1), m.group(2)
    if unit is None:
        raise ConfigError(f'{where}: {text!r} has no unit; give one '
                          f'(e.g. {_listing([number.strip() + u for u in units if u in _WHOLE])})')
    value = Fraction(number)
    if unit in _WHOLE and value.denominator != 1:
        raise ConfigError(f'{where}: {text!r}: {unit} needs a whole number')
    if value > {'dur': 1, '%': 100}.get(unit, math.inf):
        raise ConfigError(f'{where}: {text!r} is more than the whole run (1dur, 100%)')
    if positive and value <= 0:
        raise ConfigError(f'{where}: must be positive, got {text!r}')
    return Time(value, unit, str(text).strip())


def to_batches(time: Time, where: str, *, batches_per_epoch: Optional[int] = None,
               samples_per_batch: Optional[int] = None, tokens_per_batch: Optional[int] = None,
               total_batches: Optional[int] = None, round_up: bool = False) -> int:
    """``time`` as global batches, given the sizes its unit needs (``None``: refused). Exact: a time
    that is not whole batches is refused with the nearest whole ones, so every rank and every resume
    switches at the same batch; ``round_up``: the batch that reaches it instead."""
    per_batch = {'ba': Fraction(1), 'sp': samples_per_batch, 'tok': tokens_per_batch,
                 'ep': batches_per_epoch and Fraction(1, batches_per_epoch),
                 'dur': total_batches and Fraction(1, total_batches),
                 '%': total_batches and Fraction(100, total_batches)}[time.unit]
    if not per_batch:
        raise ConfigError(f'{where}: {time.text} has no fixed number of global batches in this run; '
                          f'give it in batches (ba)')
    batches = time.value / per_batch
    if batches.denominator == 1:
        return int(batches)
    if round_up:
        return math.ceil(batches)
    low, high = math.floor(batches), math.ceil(batches)
    if time.unit in ('sp', 'tok'):
        of, options = f'of {per_batch:,} {UNIT_WORDS[time.unit]}', [f'{n * per_batch}{time.unit}'
                                                                  for n in (low, high) if n]
    else:
        of, options = f'(the run is {total_batches:,} batches)', [f'{n}ba' for n in (low, high) if n]
    raise ConfigError(f'{where}: {time.text} is not a whole number of global batches {of}: '
                      f'{float(batches):.4g} batches; use {" or ".join(options)}')


class Duration(str):
    """A run's or a stage's length (``max_duration``, a stage's ``duration``): a positive whole
    number of ep, ba, sp or tok, unit required."""

    @classmethod
    def from_config(cls, value: Any, where: str) -> 'Duration':
        text = read_value(value, str, where)
        parse_time(text, where, DURATION_UNITS, positive=True)
        return cls(text)


class Interval(str):
    """How often something happens (``eval_interval``, ``save_interval``, ``log_interval``,
    ``t_warmup``, ...): whole ep, ba, sp or tok, or a fraction of the run (``0.05dur``), unit
    required: a bare ``1`` would be read by the trainer as a time delta, not an epoch or a batch."""

    @classmethod
    def from_config(cls, value: Any, where: str) -> 'Interval':
        text = read_value(value, str, where)
        parse_time(text, where, INTERVAL_UNITS)
        return cls(text)

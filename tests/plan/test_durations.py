"""One duration rule: ``parse_time`` reads every duration of a config and ``to_batches`` turns
it into global batches, checked against counting the batches one by one."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from foundrymix.config import (DURATION_UNITS, INTERVAL_UNITS, SPAN_UNITS, ConfigError, Duration, Interval,
                               parse_time, to_batches)

#: the sizes of a run: batches per epoch, samples and tokens per global batch, total batches
BPE, SPB, TPB, TOTAL = 7, 6, 6 * 16, 40


def counted(unit: str, value: Fraction, round_up: bool) -> tuple[int, int, int]:
    """(batches or -1 when not whole, the last count below it, the first count reaching it),
    counting batch after batch how much of ``unit`` the run has trained."""
    per = {'ba': 1, 'sp': SPB, 'tok': TPB, 'ep': Fraction(1, BPE), 'dur': Fraction(1, TOTAL),
           '%': Fraction(100, TOTAL)}[unit]
    trained, batches = Fraction(0), 0
    while trained + per <= value:
        trained += per
        batches += 1
    low = batches
    if trained == value:
        return batches, low, low
    return (batches + 1 if round_up else -1), low, batches + 1


def sizes() -> dict:
    return dict(batches_per_epoch=BPE, samples_per_batch=SPB, tokens_per_batch=TPB, total_batches=TOTAL)


@pytest.mark.parametrize('unit, values', [
    ('ba', [1, 2, 39, 1000]),
    ('ep', [1, 2, 5]),
    ('sp', [1, 5, 6, 7, 11, 12, 13, 240, 241]),         # below, at and past a batch's 6 samples
    ('tok', [1, 95, 96, 97, 191, 192, 193, 96 * 40]),   # a batch is 96 tokens
    ('dur', ['0.025', '0.05', '0.0375', '0.1', '.5', '0.99', '1']),  # 1/40 of the run is one batch
    ('%', ['2.5', '5', '3.75', '10', '99', '100']),
])
@pytest.mark.parametrize('round_up', [False, True])
def test_to_batches_agrees_with_counting_batches(unit, values, round_up):
    for v in values:
        text = f'{v}{unit}'
        want, low, high = counted(unit, Fraction(str(v)), round_up)
        time = parse_time(text, 'd')
        if want >= 0:
            assert to_batches(time, 'd', round_up=round_up, **sizes()) == want, text
            continue
        with pytest.raises(ConfigError) as e:
            to_batches(time, 'd', **sizes())
        per = {'sp': SPB, 'tok': TPB}.get(unit)
        options = [f'{n * per}{unit}' if per else f'{n}ba' for n in (low, high) if n]
        assert str(e.value).endswith(f'use {" or ".join(options)}'), (text, str(e.value))
        assert str(e.value).startswith(f'd: {text} is not a whole number of global batches'), str(e.value)


def test_a_unit_without_a_size_is_refused():
    """Epochs of a run with stages, samples when the stages' batches differ: no fixed count."""
    with pytest.raises(ConfigError, match=r'^s: 2ep has no fixed number of global batches'):
        to_batches(parse_time('2ep', 's'), 's', samples_per_batch=4, tokens_per_batch=64)
    with pytest.raises(ConfigError, match=r'^s: 8sp has no fixed number'):
        to_batches(parse_time('8sp', 's'), 's', batches_per_epoch=3)


@pytest.mark.parametrize('text, units, message', [
    ('10', DURATION_UNITS, "'10' has no unit; give one (e.g. 10ep, 10ba, 10sp or 10tok)"),
    ('3xx', DURATION_UNITS, "'3xx' is not a duration: a number and its unit, ep, ba, sp or tok "
                            "(e.g. 3ep, 100ba, 5000sp, 1000000tok)"),
    ('0.5dur', DURATION_UNITS, "'0.5dur' is not a duration: a number and its unit, ep, ba, sp or tok"),
    ('10%', INTERVAL_UNITS, "'10%' is not a duration: a number and its unit, ba, sp, tok, ep or dur"),
    ('1.5ba', SPAN_UNITS, "'1.5ba': ba needs a whole number"),
    ('1.01dur', SPAN_UNITS, "'1.01dur' is more than the whole run (1dur, 100%)"),
    ('100.5%', SPAN_UNITS, "'100.5%' is more than the whole run (1dur, 100%)"),
    ('-1ba', SPAN_UNITS, "'-1ba' is not a duration"),
    ('1EP', SPAN_UNITS, "'1EP' is not a duration"),
    ('5', ('ba',), "'5' has no unit; give one (e.g. 5ba)"),
])
def test_parse_time_refusals(text, units, message):
    with pytest.raises(ConfigError) as e:
        parse_time(text, 'k', units)
    assert str(e.value).startswith(f'k: {message}') and '\n' not in str(e.value), str(e.value)


def test_parse_time_reads_exact_values():
    for text, (value, unit) in {' 3ep ': (3, 'ep'), '100 ba': (100, 'ba'), '0.1dur': (Fraction(1, 10), 'dur'),
                                '.5dur': (Fraction(1, 2), 'dur'), '12.5%': (Fraction(25, 2), '%'),
                                '2.0sp': (2, 'sp'), '0ba': (0, 'ba')}.items():
        time = parse_time(text, 'k')
        assert (time.value, time.unit, time.text) == (value, unit, text.strip())
    with pytest.raises(ConfigError, match=r"^k: must be positive, got '0ba'$"):
        parse_time('0ba', 'k', positive=True)


def test_every_config_time_is_read_by_the_one_parser():
    """A max_duration, an interval, an LR span and an adaptive segment refuse alike."""
    from foundrymix.plan.specs import AdaptiveConfig
    from foundrymix.train.lr_schedule import Span
    for reader, units, positive in [(Duration.from_config, DURATION_UNITS, True),
                                    (Interval.from_config, INTERVAL_UNITS, False),
                                    (Span.from_config, SPAN_UNITS, True)]:
        for text in ('7', '1.5ba', '0ba', '2dur', '3xx', '12ba'):
            try:
                parse_time(text, 'k', units, positive)
                want = None
            except ConfigError as e:
                want = str(e)
            try:
                reader(text, 'k')
                got = None
            except ConfigError as e:
                got = str(e).replace('k.duration', 'k')
            assert got == want, (reader, text)
    every = AdaptiveConfig(every='5')
    with pytest.raises(ConfigError) as e:
        every.check('a')
    assert str(e.value) == "a.every: '5' has no unit; give one (e.g. 5ba)"
    assert [AdaptiveConfig(every=f'{n}ba').batches('every', 'a') for n in (1, 50)] == [1, 50]


def test_rounding_up_is_the_batch_that_reaches_the_time():
    """round_up over every sample and token count up to four batches: the first batch count
    whose rows (tokens) reach it, as a run stops."""
    for unit, per in (('sp', SPB), ('tok', TPB)):
        for value in range(1, 4 * per + 1):
            first = next(b for b in itertools.count() if b * per >= value)
            got = to_batches(parse_time(f'{value}{unit}', 'd'), 'd', round_up=True, **sizes())
            assert got == first, (value, unit)

"""Weights in rows (groups, token shares, ``Stream.apply_weights``' meaning of a weight), and
exact epochs: whole global batches per epoch (an epoch is one block of the order, so ranks slice
every batch evenly), trimmed rows going on in the next epoch; stratified shares that are whole
rows. Every share becomes whole rows through one rule, :func:`apportion`."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from foundrymix.config import ConfigError
from foundrymix.plan.config import LoaderConfig

if TYPE_CHECKING:  # the catalog imports this module (resolve_groups)
    from foundrymix.plan.catalog import StreamInfo


def apportion(weights: Sequence[Any], total: int) -> np.ndarray:
    """``total`` whole units split in proportion to ``weights`` (non-negative ints, floats or
    fractions, taken at their exact values): each gets the floor of its exact share, and the units
    left go one each to the largest remainders, equal remainders to the earlier weight (config
    order). The plan's one rounding: whole rows are a function of the weights alone, never of a
    seed; with ``total`` at most the weights' sum, none gets more than its weight."""
    w = np.asarray(weights)
    if w.dtype.kind not in 'iu':  # floats, fractions: exact integers over a common denominator
        exact = [Fraction(x) for x in w.tolist()]
        den = math.lcm(*(f.denominator for f in exact))
        w = np.array([int(f * den) for f in exact], object)
    whole = sum(w.tolist())
    if total <= 0 or whole <= 0:
        if total > 0:
            raise ValueError(f'{total} units apportioned over weights that sum to zero')
        return np.zeros(len(w), np.int64)
    if w.dtype.kind in 'iu' and whole < (1 << 62) and int(w.max()) < (1 << 62) // total:
        share, rest = np.divmod(w.astype(np.int64) * total, whole)
    else:  # exact for any size: Python integers
        pairs = [divmod(int(c) * total, whole) for c in w.tolist()]
        share, rest = np.array([q for q, _ in pairs], object), [r for _, r in pairs]
    share = share.astype(np.int64)
    share[sorted(range(len(share)), key=lambda i: (-rest[i], i))[:total - int(share.sum())]] += 1
    return share


@dataclass(frozen=True)
class EpochWeights:
    """How one epoch samples each stream (in ``Stream.apply_weights``'s terms)."""

    epoch_size: Optional[int]            # ``apply_weights``'s ``epoch_size`` argument
    chooses: Optional[tuple[int, ...]]   # per-stream ``choose`` replacing repeat/choose, if trimmed
    nominal: tuple[int, ...]             # rows per stream per epoch the weights ask for
    rows: tuple[int, ...]                # rows per stream per epoch actually sampled

    @property
    def left_out(self) -> tuple[int, ...]:
        """Rows per stream per epoch the weights ask for but the exact epoch leaves out."""
        return tuple(max(0, n - r) for n, r in zip(self.nominal, self.rows))

    @property
    def added(self) -> tuple[int, ...]:
        """Rows per stream per epoch beyond what the weights ask (a lowered ``epoch_size`` rounds some up)."""
        return tuple(max(0, r - n) for n, r in zip(self.nominal, self.rows))


@dataclass(frozen=True)
class Weighted:
    """Rows per stream per epoch, the epoch's size, and the exact weights the rows are made from
    (each stream's share of the epoch is its weight over their sum)."""

    chooses: np.ndarray
    epoch_size: int
    weights: tuple[Any, ...]


def weighted(infos: list[StreamInfo], weights: EpochWeights, weights_in: str = 'rows') -> Weighted:
    """``weights`` applied to the streams as streaming's ``Stream.apply_weights`` applies them
    (tested against it), except that relative weights are made whole rows by :func:`apportion`
    rather than a seeded draw. ``weights.chooses`` replaces the configured weights when an exact
    epoch trimmed them."""
    rows = np.array([i.rows for i in infos], np.int64)
    size = weights.epoch_size
    if weights.chooses is not None:
        given: list[Any] = [('choose', c) for c in weights.chooses]
    else:
        props = row_proportions(infos, weights_in)
        given = [('proportion', p) if p is not None else ('repeat', i.spec.repeat)
                 if i.spec.repeat is not None else ('choose', i.spec.choose)
                 if i.spec.choose is not None else (None, None) for p, i in zip(props, infos)]
    kinds = {k for k, _ in given}  # one kind, or no epoch_size: LoaderConfig.check refuses the rest
    if kinds == {'proportion'} or (kinds == {None} and size):
        exact = tuple(v for _, v in given) if kinds == {'proportion'} else tuple(rows.tolist())
        total = size or int(rows.sum())
        return Weighted(apportion(exact, total), int(total), exact)
    chooses = np.array([int(v * r) if k == 'repeat' else int(v) if k == 'choose' else int(r)
                        for (k, v), r in zip(given, rows)], np.int64)
    return Weighted(chooses, int(chooses.sum()), tuple(chooses.tolist()))


def epoch_weights(config: LoaderConfig, infos: list[StreamInfo], global_batch: int,
                  where: str = 'train_loader') -> EpochWeights:
    """The epoch's weights for ``global_batch`` rows per step: trimmed to whole global batches;
    stratified shares checked unless ``exact: false`` (which trains the rounded shares)."""
    anchored = anchored_epoch(infos, config.weights_in)
    requested = anchored.epoch_size if anchored is not None else config.epoch_size or None
    w = weighted(infos, EpochWeights(requested, None, (), ()), config.weights_in)
    size, nominal = w.epoch_size, tuple(int(c) for c in w.chooses)
    base = EpochWeights(requested, None, nominal, nominal)
    if config.batching_method == 'stratified':  # every batch is a block of whole rows
        if config.exact:
            check_stratified([i.name for i in infos], w.weights, global_batch, where)
        return base
    cut = size % global_batch
    if cut == 0 or size - cut <= 0:  # (no whole batch at all: the plan refuses it, naming why)
        return base
    if anchored is None and all(i.spec.weight_kind in (None, 'proportion') for i in infos):
        trimmed = EpochWeights(size - cut, None, nominal, ())
    else:
        trimmed = EpochWeights(None, trim_chooses(nominal, cut, tuple(i.rows for i in infos)), nominal, ())
    return replace(trimmed, rows=tuple(int(c) for c in weighted(infos, trimmed, config.weights_in).chooses))


@dataclass(frozen=True)
class Anchor:
    """A stream whose ``proportion`` comes with ``repeat``: its whole passes size the epoch."""

    index: int
    rows: int          # its rows in an epoch: ``repeat`` times the stream
    epoch_size: int    # the epoch in which its share is exactly ``rows``


def anchored_epoch(infos: list[StreamInfo], weights_in: str) -> Optional[Anchor]:
    """The epoch size at which the stream with ``proportion`` and ``repeat`` gets exactly its
    passes by :func:`apportion` (the nearest such size to the exact quotient), or None."""
    a = next((k for k, i in enumerate(infos) if i.spec.proportion is not None and i.spec.repeat is not None), None)
    if a is None:
        return None
    exact = [Fraction(p) for p in row_proportions(infos, weights_in)]
    want = int(infos[a].spec.repeat * infos[a].rows)  # type: ignore[operator]
    if want <= 0 or exact[a] <= 0:
        raise ConfigError(f'{infos[a].where}: repeat {infos[a].spec.repeat} with proportion '
                          f'{infos[a].spec.proportion} makes no rows of it; give both positive')
    quotient = want * sum(exact) / exact[a]
    sizes = sorted(range(max(1, math.floor(quotient) - 2), math.ceil(quotient) + 3), key=lambda e: abs(e - quotient))
    size = next((e for e in sizes if int(apportion(exact, e)[a]) == want), round(quotient))
    return Anchor(a, want, size)


def trim_chooses(chooses: tuple[int, ...], cut: int,
                 rows: Optional[tuple[int, ...]] = None) -> tuple[int, ...]:
    """``chooses`` less ``cut`` rows in all: first from the fractional passes (``choose % rows``),
    so whole passes are kept, each split in proportion so that shares move least."""
    extras = tuple(c % n for c, n in zip(chooses, rows)) if rows else tuple(0 for _ in chooses)
    first = apportion(extras, min(cut, sum(extras))).tolist()
    left = tuple(c - k for c, k in zip(chooses, first))
    return tuple(int(c - k) for c, k in zip(left, apportion(left, cut - sum(first))))


def _whole(proportions: list[float], batch: int) -> bool:
    return all(abs(p * batch - round(p * batch)) < 1e-6 for p in proportions)


def check_stratified(names: list[str], weights: Sequence[Any], global_batch: int,
                     where: str = 'train_loader') -> None:
    """Refuse stratified batching whose requested shares are not whole rows of a global batch."""
    proportions = [float(x) / float(sum(weights)) for x in weights]
    if _whole(proportions, global_batch):
        return
    portions = apportion(weights, global_batch).tolist()
    trains = ' + '.join(f'{n} {k}' for n, k in zip(names, portions))
    real = ', '.join(f'{n} {k / global_batch:.1%}' for n, k in zip(names, portions))
    asked = ', '.join(f'{n} {p:.4g}' for n, p in zip(names, proportions))
    fits = next((g for g in range(global_batch + 1, 64 * global_batch + 1)
                 if _whole(proportions, g)), None)
    hint = (f'a global batch of {fits} (the nearest larger one with whole shares; '
            f'global_train_batch_size must also divide over the ranks), or ' if fits else '')
    nearest = ', '.join(f'{n} {k}/{global_batch}' for n, k in zip(names, portions))
    raise ConfigError(
        f'{where}.batching_method: stratified with proportions {asked} cannot be realized in a '
        f'global batch of {global_batch}: every batch would train {trains} rows ({real}). Use '
        f'{hint}proportions that are multiples of 1/{global_batch} (nearest: {nearest}), or set '
        f'{where}.exact: false to train the rounded shares')


def units_per_row(info: StreamInfo, weights_in: str) -> float:
    """Rows, real tokens or loss tokens per row of a stream, on average (from its manifest)."""
    c = info.manifest.counts
    if weights_in == 'rows':
        return 1.0
    total = c.tokens if weights_in == 'tokens' else c.loss_tokens
    if total <= 0:
        raise ConfigError(f'{info.where}: weights_in {weights_in}: the stream has no '
                          f'{weights_in.replace("_", " ")}, so no share of them can be drawn from it')
    return total / c.rows


def resolve_groups(config: LoaderConfig, infos: list[StreamInfo],
                   where: str = 'train_loader') -> list[StreamInfo]:
    """``infos`` with every group member's weight set from its group (``config.groups``):
    ``repeat`` per member, ``proportion`` spread by size (in ``weights_in`` units), ``choose``
    split by rows in whole numbers with the exact sum."""
    if not config.groups:
        return infos
    by_name = {i.name: i for i in infos}
    weights: dict[str, dict[str, Any]] = {}
    for pattern, members in config.group_members(where).items():
        group = config.groups[pattern]
        ms = [by_name[n] for n in members]
        if group.repeat is not None:
            weights.update({m.name: {'repeat': group.repeat} for m in ms})
        elif group.proportion is not None:
            sizes = [m.rows * units_per_row(m, config.weights_in) for m in ms]
            total = sum(sizes)
            weights.update({m.name: {'proportion': group.proportion * s / total}
                            for m, s in zip(ms, sizes)})
        else:
            assert group.choose is not None, 'a pattern gives a weight (StreamSpec.check)'
            split = apportion([m.rows for m in ms], group.choose).tolist()
            weights.update({m.name: {'choose': c} for m, c in zip(ms, split)})
    return [replace(i, spec=replace(i.spec, **weights[i.name]))
            if i.name in weights else i for i in infos]


def row_proportions(infos: list[StreamInfo], weights_in: str) -> list[Optional[float]]:
    """The row proportions that give the streams' ``proportion`` as shares of ``weights_in``:
    ``p_i / (units per row)_i``, rescaled to the requested sum (other weights pass through)."""
    given = [i.spec.proportion for i in infos]
    if weights_in == 'rows' or any(p is None for p in given):
        return given
    raw = [p / units_per_row(i, weights_in) for p, i in zip(given, infos)]  # type: ignore[operator]
    scale = sum(given) / sum(raw) if sum(raw) > 0 else 0.0  # type: ignore[arg-type]
    return [r * scale for r in raw]

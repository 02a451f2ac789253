"""Exact epochs: whole global batches per epoch, and stratified shares that are whole rows.

An epoch is one block of the order (:mod:`foundrymix.plan.order`), so it must be whole
global batches: ranks then slice every batch evenly and no row is padded or repeated to
even them out. The epoch is lowered to a multiple of the global batch by lowering
``epoch_size`` (relative weights, split by proportion) or by trimming ``choose`` per
stream, from fractional passes first, in proportion (absolute weights). A trimmed row is
not lost: its stream's draws continue in the next epoch. Stratified batching whose
per-batch shares cannot be whole rows is refused, naming the shares it would train and
the nearest global batch that fits. The same :func:`epoch_weights` feeds the plan and the
loader, so what is planned is what is trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from foundrymix.config import ConfigError, number_abbrev_to_int
from foundrymix.plan.catalog import StreamInfo, make_streams
from foundrymix.plan.config import LoaderConfig


@dataclass(frozen=True)
class EpochWeights:
    """How one epoch samples each stream, as handed to ``StreamingDataset``."""

    epoch_size: Optional[int]            # streaming's ``epoch_size`` argument
    chooses: Optional[tuple[int, ...]]   # per-stream ``choose`` replacing repeat/choose, if trimmed
    nominal: tuple[int, ...]             # rows per stream per epoch the weights ask for
    rows: tuple[int, ...]                # rows per stream per epoch actually sampled
    unit: int                            # the epoch is a multiple of this (1 if not exact)

    @property
    def left_out(self) -> tuple[int, ...]:
        """Rows per stream per epoch the weights ask for but the exact epoch leaves out."""
        return tuple(n - r for n, r in zip(self.nominal, self.rows))


def weighted_streams(infos: list[StreamInfo], weights: EpochWeights, seed: int,
                     weights_in: str = 'rows') -> tuple[list[Any], int]:
    """Fresh streams with ``weights`` applied exactly as ``StreamingDataset.__init__`` applies
    them; returns (streams, epoch size)."""
    from streaming import Stream
    streams = make_streams(infos, weights.chooses, weights_in)
    rows = np.array([i.rows for i in infos], np.int64)
    return streams, Stream.apply_weights(streams, rows, weights.epoch_size, seed)


def epoch_weights(config: LoaderConfig, infos: list[StreamInfo], global_batch: int,
                  where: str = 'train_loader') -> EpochWeights:
    """The epoch's weights for ``global_batch`` rows per step: trimmed to whole global batches
    (batching ``random``: an epoch is one block of the order); stratified shares checked
    unless ``exact: false`` (which trains the rounded shares)."""
    requested = number_abbrev_to_int(str(config.epoch_size)) if config.epoch_size else None
    base = EpochWeights(requested, None, (), (), 1)
    streams, size = weighted_streams(infos, base, config.shuffle_seed, config.weights_in)
    nominal = tuple(int(s.choose) for s in streams)
    base = EpochWeights(requested, None, nominal, nominal, 1)
    if config.batching_method == 'stratified':  # every batch is a block of whole rows
        if config.exact:
            check_stratified([i.name for i in infos], [float(s.proportion) for s in streams],
                             global_batch, where)
        return base
    unit = global_batch
    cut = size % unit
    if cut == 0 or size - cut <= 0:  # (no whole batch at all: the plan refuses it, naming why)
        return EpochWeights(requested, None, nominal, nominal, unit)
    if all(i.spec.weight_kind in (None, 'proportion') for i in infos):
        trimmed = EpochWeights(size - cut, None, nominal, (), unit)
    else:
        rows = tuple(i.rows for i in infos)
        trimmed = EpochWeights(None, trim_chooses(nominal, cut, rows), nominal, (), unit)
    streams, _ = weighted_streams(infos, trimmed, config.shuffle_seed, config.weights_in)
    return EpochWeights(trimmed.epoch_size, trimmed.chooses, nominal,
                        tuple(int(s.choose) for s in streams), unit)


def trim_chooses(chooses: tuple[int, ...], cut: int,
                 rows: Optional[tuple[int, ...]] = None) -> tuple[int, ...]:
    """``chooses`` less ``cut`` rows in all.

    Taken first from the streams' fractional passes (``choose % rows``: rows already drawn
    as a random subset each epoch), so a stream asked for whole passes keeps them; split in
    proportion (largest remainder, ties to the earlier stream) so shares move least.
    """
    extras = tuple(c % n for c, n in zip(chooses, rows)) if rows else tuple(0 for _ in chooses)
    first = _split(min(cut, sum(extras)), extras)
    left = tuple(c - k for c, k in zip(chooses, first))
    return tuple(c - k for c, k in zip(left, _split(cut - sum(first), left)))


def _split(cut: int, caps: tuple[int, ...]) -> tuple[int, ...]:
    """``cut`` split over ``caps`` in proportion to them, none above its cap."""
    total = sum(caps)
    if cut <= 0 or total <= 0:
        return tuple(0 for _ in caps)
    exact = [cut * c / total for c in caps]
    cuts = [min(int(x), c) for x, c in zip(exact, caps)]
    for i in sorted(range(len(caps)), key=lambda i: (-(exact[i] - cuts[i]), i)):
        if sum(cuts) == cut:
            break
        if cuts[i] < caps[i]:
            cuts[i] += 1
    return tuple(cuts)


def stratified_portions(proportions: list[float], global_batch: int) -> list[int]:
    """Rows per stream in every global batch, computed as streaming's stratified batching does
    (``int(p x G)``, the shortfall to the largest remainders)."""
    props = np.array(proportions, np.float64)
    portions = np.array([int(p * global_batch) for p in proportions], np.int64)
    missing = global_batch - int(portions.sum())
    if missing > 0:
        leftover = global_batch * props - portions
        portions[np.flip(np.argsort(leftover))[:missing]] += 1
    return [int(p) for p in portions]


def _whole(proportions: list[float], batch: int) -> bool:
    return all(abs(p * batch - round(p * batch)) < 1e-6 for p in proportions)


def check_stratified(names: list[str], proportions: list[float], global_batch: int,
                     where: str = 'train_loader') -> None:
    """Refuse stratified batching whose requested shares are not whole rows of a global batch."""
    if _whole(proportions, global_batch):
        return
    portions = stratified_portions(proportions, global_batch)
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

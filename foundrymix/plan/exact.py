"""Weights in rows (groups, token shares, ``Stream.apply_weights``' arithmetic), and exact
epochs: whole global batches per epoch (an epoch is one block of the order, so ranks slice every
batch evenly), trimmed rows going on in the next epoch; stratified shares that are whole rows."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from foundrymix.config import ConfigError, number_abbrev_to_int
from foundrymix.plan.config import LoaderConfig

if TYPE_CHECKING:  # the catalog imports this module (resolve_groups)
    from foundrymix.plan.catalog import StreamInfo


@dataclass(frozen=True)
class EpochWeights:
    """How one epoch samples each stream (in ``Stream.apply_weights``'s terms)."""

    epoch_size: Optional[int]            # ``apply_weights``'s ``epoch_size`` argument
    chooses: Optional[tuple[int, ...]]   # per-stream ``choose`` replacing repeat/choose, if trimmed
    nominal: tuple[int, ...]             # rows per stream per epoch the weights ask for
    rows: tuple[int, ...]                # rows per stream per epoch actually sampled
    unit: int                            # the epoch is a multiple of this (1 if not exact)

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
    """Rows per stream per epoch, each stream's share of the epoch, and the epoch's size."""

    chooses: np.ndarray
    proportions: np.ndarray
    epoch_size: int


def weighted(infos: list[StreamInfo], weights: EpochWeights, seed: int,
             weights_in: str = 'rows') -> Weighted:
    """``weights`` applied to the streams exactly as streaming's ``Stream.apply_weights`` applies
    them (tested against it), in plain numpy, so a weight means what it means there.
    ``weights.chooses`` replaces the configured weights when an exact epoch trimmed them."""
    rows = np.array([i.rows for i in infos], np.int64)
    size = weights.epoch_size
    if weights.chooses is not None:
        given: list[Any] = [('choose', c) for c in weights.chooses]
    else:
        props = row_proportions(infos, weights_in)
        given = [('proportion', p) if p is not None else ('repeat', i.spec.repeat)
                 if i.spec.repeat is not None else ('choose', i.spec.choose)
                 if i.spec.choose is not None else (None, None) for p, i in zip(props, infos)]
    kinds = {k for k, _ in given}
    if kinds == {'proportion'} or (kinds == {None} and size):
        shares = (np.array([v for _, v in given], np.float64) if kinds == {'proportion'}
                  else rows.astype(np.float64))
        shares /= shares.sum()
        total = size or int(rows.sum())
        chooses = (total * shares).astype(np.int64)
        chooses[np.random.default_rng(seed).choice(len(infos), total - int(chooses.sum()), False)] += 1
        return Weighted(chooses, shares, int(total))
    if 'proportion' in kinds or size:  # LoaderConfig refuses both before a plan is made
        raise ConfigError('relative and absolute weights mixed, or an epoch_size with absolute weights')
    chooses = np.array([int(v * r) if k == 'repeat' else int(v) if k == 'choose' else int(r)
                        for (k, v), r in zip(given, rows)], np.int64)
    with np.errstate(invalid='ignore', divide='ignore'):
        return Weighted(chooses, chooses / chooses.sum(), int(chooses.sum()))


def epoch_weights(config: LoaderConfig, infos: list[StreamInfo], global_batch: int,
                  where: str = 'train_loader') -> EpochWeights:
    """The epoch's weights for ``global_batch`` rows per step: trimmed to whole global batches;
    stratified shares checked unless ``exact: false`` (which trains the rounded shares)."""
    requested = number_abbrev_to_int(str(config.epoch_size)) if config.epoch_size else None
    base = EpochWeights(requested, None, (), (), 1)
    w = weighted(infos, base, config.shuffle_seed, config.weights_in)
    size, nominal = w.epoch_size, tuple(int(c) for c in w.chooses)
    base = EpochWeights(requested, None, nominal, nominal, 1)
    if config.batching_method == 'stratified':  # every batch is a block of whole rows
        if config.exact:
            check_stratified([i.name for i in infos], [float(p) for p in w.proportions],
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
    rows = tuple(int(c) for c in weighted(infos, trimmed, config.shuffle_seed, config.weights_in).chooses)
    return EpochWeights(trimmed.epoch_size, trimmed.chooses, nominal, rows, unit)


def trim_chooses(chooses: tuple[int, ...], cut: int,
                 rows: Optional[tuple[int, ...]] = None) -> tuple[int, ...]:
    """``chooses`` less ``cut`` rows in all: first from the fractional passes (``choose % rows``),
    so whole passes are kept, each split in proportion so that shares move least."""
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
            split = split_whole(group.choose, [m.rows for m in ms])
            weights.update({m.name: {'choose': c} for m, c in zip(ms, split)})
    return [replace(i, spec=replace(i.spec, **weights[i.name]))
            if i.name in weights else i for i in infos]


def split_whole(total: int, sizes: list[int]) -> list[int]:
    """``total`` split in proportion to ``sizes`` as whole numbers summing to ``total``
    exactly (largest remainder; ties to the earlier one)."""
    whole = sum(sizes)
    floors = [total * s // whole for s in sizes]
    rests = [total * s % whole for s in sizes]
    for i in sorted(range(len(sizes)), key=lambda i: (-rests[i], i))[:total - sum(floors)]:
        floors[i] += 1
    return floors


def row_proportions(infos: list[StreamInfo], weights_in: str) -> list[Optional[float]]:
    """The row proportions that give the streams' ``proportion`` as shares of ``weights_in``:
    ``p_i / (units per row)_i``, rescaled to the requested sum (other weights pass through)."""
    given = [i.spec.proportion for i in infos]
    if weights_in == 'rows' or any(p is None for p in given):
        return given
    raw = [p / units_per_row(i, weights_in) for p, i in zip(given, infos)]  # type: ignore[operator]
    scale = sum(given) / sum(raw) if sum(raw) > 0 else 0.0  # type: ignore[arg-type]
    return [r * scale for r in raw]

"""The exact plan of a mixture: rows, passes, shares and tokens per epoch; where a run ends.
Every number is the arithmetic of the order the loader reads (:mod:`foundrymix.plan.order`):
nothing is replayed, no shard is read. Real and loss tokens are expected values unless whole
passes or uniform rows make them exact (``tokens_exact``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np

from foundrymix.config import DURATION_UNITS, UNIT_WORDS, ConfigError, parse_time, to_batches
from foundrymix.plan.catalog import StreamInfo
from foundrymix.plan.config import LoaderConfig
from foundrymix.plan.exact import EpochWeights, anchored_epoch, apportion, epoch_weights, weighted
from foundrymix.plan.order import WINDOW_ROWS, StageOrder, name_key, rank_counts, stream_draws
from foundrymix.plan.plans import DurationPlan, GroupPlan, Plan, RankPlan, StreamPlan
from foundrymix.plan.topology import Topology
from foundrymix.plan.window import cache_window

__all__ = ['Plan', 'StreamPlan', 'RankPlan', 'DurationPlan', 'Topology', 'build_plan']


#: by default, per-rank rows per stream are counted up to this many rows an epoch
RANK_COUNT_LIMIT = 50_000_000
#: a class of per-stream warning gets one line per stream up to this many streams, then one line
WARNING_LINES_PER_CLASS = 3
#: ends the one line that stands for a class of per-stream warnings
EVERY_STREAM_HINT = '(every stream: plan --streams all, or --json)'


def stream_groups(config: LoaderConfig) -> list[GroupPlan]:
    """The config's groups with their members, for the plan (empty without patterns)."""
    kinds = {p: str(g.weight_kind) for p, g in config.groups.items()}  # one each: StreamSpec.check
    return [GroupPlan(pattern=p, members=members, weight=kinds[p], value=getattr(config.groups[p], kinds[p]))
            for p, members in config.group_members().items()]


@dataclass
class _Epoch:
    """One epoch's numbers, for the :class:`StreamPlan` rows."""

    chooses: np.ndarray         # rows sampled per stream per epoch
    epoch_size: int
    trained: np.ndarray         # rows trained per stream per epoch (whole batches)
    shares: np.ndarray          # share of the rows trained, per stream (stratified: per batch)
    weights: EpochWeights
    batches: int
    order: StageOrder           # the stage's order: counts of any prefix by arithmetic


def build_plan(config: LoaderConfig, infos: list[StreamInfo], batch_size: int,
               max_duration: Optional[Any] = None, topology: Topology = Topology(),
               stage: str = 'main', rank_count_limit: Optional[int] = RANK_COUNT_LIMIT,
               stage_key: Optional[str] = None) -> tuple[Plan, StageOrder]:
    """The :class:`Plan` of a loader config over validated streams, for a per-rank batch size,
    and the order it counts. ``stage_key``: ``max_duration`` is that stage's duration, refused
    unless whole batches (a run's is rounded up). An adaptive stage's plan states no epoch notes."""
    if batch_size <= 0 or topology.nodes <= 0 or topology.ranks_per_node <= 0:
        raise ConfigError(f'batch_size ({batch_size}), nodes ({topology.nodes}) and ranks per '
                          f'node ({topology.ranks_per_node}) must be positive')
    warnings: list[str] = []
    notes: list[str] = []
    L = infos[0].manifest.max_seq_len
    G = batch_size * topology.world_size
    epoch = _plan_epoch(config, infos, batch_size, topology, stage)
    epochs = config.adaptive is None
    _warn_epoch(config, epoch, G, warnings, epochs)
    if epochs:
        _note_exact(config, epoch, G, warnings, notes)
    names = [i.name for i in infos]
    stream_plans = _stream_plans(infos, epoch, L, warnings if epochs else [], notes if epochs else [])
    if config.weights_in != 'rows':
        notes.append(weights_in_note(config.weights_in, stream_plans, L))
    anchor = anchored_epoch(infos, config.weights_in)
    if anchor is not None:
        i = infos[anchor.index]
        notes.append(f'the epoch is sized by {i.name}\'s repeat: {i.spec.repeat:g} beside its proportion: '
                     f'{i.spec.proportion:g}: {anchor.rows:,} rows of it ({i.spec.repeat:g} x {i.rows:,}) are '
                     f'its share of an epoch of {anchor.epoch_size:,} rows; whole passes are kept when the '
                     f'epoch is cut to whole global batches')
    notes.extend(foundry_note(i) for i in infos if i.manifest.options.get('format') == 'llm-foundry-tokens')
    window = cache_window(config, infos)
    if config.shuffle and not config.shuffle_block_size and window != WINDOW_ROWS:
        notes.append(f'shuffle window: {window:,} rows (the default, {WINDOW_ROWS:,}, does not fit '
                     f'cache_limit {config.cache_limit}): each shard is fetched about once per pass')
    per_rank, how_ranks = _rank_plans(epoch, topology, names, rank_count_limit)
    plan = Plan(streams=stream_plans,
                epoch_size=epoch.epoch_size, batch_size=batch_size,
                world_size=topology.world_size, global_batch_size=G,
                batches_per_epoch=epoch.batches, samples_per_epoch=int(epoch.trained.sum()),
                max_seq_len=L, batching_method=config.batching_method,
                shuffle_seed=config.shuffle_seed, warnings=warnings, notes=notes,
                duration_name='stage duration' if stage_key else 'max_duration', nodes=topology.nodes,
                ranks_per_node=topology.ranks_per_node,
                exact=config.exact,
                nominal_rows_per_epoch=dict(zip(names, epoch.weights.nominal)),
                left_out_per_epoch=dict(zip(names, epoch.weights.left_out)),
                per_rank=per_rank, weights=epoch.weights,
                groups=stream_groups(config), counted={'epoch': 'arithmetic', 'per_rank': how_ranks})
    if max_duration is None:
        return plan, epoch.order
    d = plan_duration(plan, max_duration, names, epoch, stage_key)
    mid = [f'{plan.duration_name} {d.max_duration} ends mid-epoch: epoch {d.last_epoch} stops after '
           f'{d.last_batch_in_epoch:,} of {epoch.batches:,} batches (sample '
           f'{d.last_sample_in_epoch:,} of {plan.samples_per_epoch:,}); the rest of that '
           f'epoch\'s rows are not trained'] if d.ends_mid_epoch and epochs else []
    return replace(plan, duration=d, counted={**plan.counted, 'run': 'arithmetic'},
                   warnings=warnings + mid), epoch.order


def share_rounding(plans: list[StreamPlan], weights_in: str, L: int) -> float:
    """How far a realized share (of ``weights_in``) can be from the requested one, at most:
    whole rows are within one row (``L`` tokens) of exact, so ``2 n L / (T - n L)``."""
    total = sum(s.tokens_per_epoch if weights_in == 'tokens' else s.loss_tokens_per_epoch for s in plans)
    slack = len(plans) * L
    return 1.0 if total <= slack else 2 * slack / (total - slack)


def foundry_note(info: StreamInfo) -> str:
    """What a stream of LLM-Foundry token shards read in place is taken to be."""
    m = info.manifest
    rule = m.options['documents']
    docs = {'eos': f'documents end after each EOS (id {m.options["separator"]})',
            'bos': f'documents start at each BOS (id {m.options["separator"]})',
            'none': 'no EOS or BOS of the tokenizer in shard 0: each row is one document'}[rule]
    where = (f'nothing is written into {info.directory}' if info.remote_dir is None else
             f'{info.remote_dir} is read; its files are downloaded into {info.directory} (the download cache, '
             f'as LLM-Foundry uses local:)')
    return (f'{info.name}: LLM-Foundry token shards read in place (tokens: {m.options["file_dtype"]}, rows of '
            f'{m.max_seq_len}, tokenizer {m.tokenizer.name}); {docs}; {where}')


def weights_in_note(weights_in: str, plans: list[StreamPlan], L: int) -> str:
    """The plan's statement of what the proportions mean and how exactly they are met."""
    col = 'tok share' if weights_in == 'tokens' else 'loss share'
    bound = share_rounding(plans, weights_in, L)
    return (f'weights_in: {weights_in}: proportions are shares of {weights_in.replace("_", " ")} '
            f'(column {col!r}), turned into row proportions from the manifests (rows: '
            + ', '.join(f'{s.name} {s.share:.1%}' for s in plans) +
            f'); rows per stream are rounded to whole rows, so a realized share differs '
            f'from the requested one by at most {100 * bound:.2g} percentage points')


def _plan_epoch(config: LoaderConfig, infos: list[StreamInfo], batch_size: int,
                topology: Topology, stage: str) -> _Epoch:
    """Rows per stream per epoch and the stage's order: an epoch is one block, or under
    stratified batching every global batch is one."""
    G = batch_size * topology.world_size
    weights = epoch_weights(config, infos, G)
    w = weighted(infos, weights, config.weights_in)
    epoch_size, chooses = w.epoch_size, w.chooses
    if config.batching_method == 'stratified':
        portions = apportion(w.weights, G)
        fits = [int(c) // int(p) for c, p in zip(chooses, portions) if p > 0]
        batches = min(fits) if fits else 0
        trained, block = portions * batches, portions
        shares = portions / G
    else:
        batches = epoch_size // G
        trained, block = chooses, chooses
        shares = chooses / epoch_size if epoch_size else np.zeros(len(infos))
    draws = stream_draws([i.shard_rows for i in infos], [i.name for i in infos], config.shuffle_seed,
                         stage, cache_window(config, infos), config.shuffle)
    order = StageOrder(draws, block if block.sum() else np.ones(1, np.int64), G,
                       (config.shuffle_seed, name_key(stage)), config.shuffle)
    return _Epoch(chooses=chooses, epoch_size=epoch_size, trained=trained,
                  shares=shares, weights=weights, batches=batches, order=order)


def _rank_plans(epoch: _Epoch, topology: Topology, names: list[str],
                limit: Optional[int]) -> tuple[list[RankPlan], str]:
    """Every rank's share of epoch 0: batches and rows by arithmetic, rows per stream counted
    (:func:`rank_counts`) up to ``limit`` rows an epoch (None: any size; 0: never)."""
    W = topology.world_size
    G = epoch.order.global_batch
    B = G // W
    rows = epoch.batches * G
    if W == 1:
        counts: Optional[np.ndarray] = epoch.trained[None, :]
    elif limit is None or rows <= limit:
        counts = rank_counts(epoch.order, epoch.batches, W)
    else:
        counts = None
    out = [RankPlan(rank=r, node=r // topology.ranks_per_node,
                    local_rank=r % topology.ranks_per_node, batches_per_epoch=epoch.batches,
                    samples_per_epoch=epoch.batches * B,
                    rows_per_stream=None if counts is None else
                    {n: int(c) for n, c in zip(names, counts[r])}) for r in range(W)]
    if counts is None:
        over = f'over {limit:,} rows an epoch' if limit else 'for a loader (it reads none)'
        return out, (f'arithmetic; rows per stream per rank not counted {over} (--rank-counts '
                     f'counts them: every position of the epoch is drawn)')
    return out, 'arithmetic' if W == 1 else 'counted'


def _warn_epoch(config: LoaderConfig, epoch: _Epoch, G: int, warnings: list[str], epochs: bool) -> None:
    """Warnings: proportions that do not sum to 1, rows an epoch samples but does not train
    (where the stage trains ``epochs``)."""
    members = {n for ms in config.group_members().values() for n in ms}  # as written: a group's once
    given = ([s.proportion for n, s in config.streams.items() if n not in members]
             + [g.proportion for g in config.groups.values()])
    total = None if None in given else float(sum(given))
    if total is not None and abs(total - 1.0) > 1e-9:
        listed = ' + '.join(f'{p:g}' for p in given)
        shares = ', '.join(f'{n} {c / epoch.epoch_size:.1%}'
                           for n, c in zip(config.streams, epoch.chooses))
        warnings.append(f'proportions sum to {total:g} ({listed}), not 1: they are normalised to '
                        f'{shares} of the epoch')
    samples, size = int(epoch.trained.sum()), epoch.epoch_size
    if samples < size and epochs:
        why = ('stratified batching keeps only whole batches of the exact composition'
               if config.batching_method == 'stratified' else
               f'epoch size {size:,} is not a multiple of the global batch {G}')
        warnings.append(f'{size - samples:,} of {size:,} sampled rows per epoch are never '
                        f'trained: {why}')


def _note_exact(config: LoaderConfig, epoch: _Epoch, G: int, warnings: list[str],
                notes: list[str]) -> None:
    """What an exact epoch leaves out; stratified shares that rounding changes (exact: false)."""
    names = list(config.streams)
    left = {n: k for n, k in zip(names, epoch.weights.left_out) if k}
    more = {n: k for n, k in zip(names, epoch.weights.added) if k}
    if left or more:
        nominal = sum(epoch.weights.nominal)
        asked = dict(zip(names, epoch.weights.nominal))
        listing = ', '.join(f'{n} {k:,} (of {asked[n]:,})' for n, k in left.items())
        if len(left) > 2 * WARNING_LINES_PER_CLASS:  # up to G - 1 streams: a line of 1,000 is noise
            first = ', '.join(f'{n} {k:,}' for n, k in list(left.items())[:WARNING_LINES_PER_CLASS])
            listing = (f'{sum(left.values()):,} rows from {len(left):,} streams, at most '
                       f'{max(left.values()):,} from one ({first}, ...; every stream: --json)')
        extra = ', '.join(f'{n} {k:,} (asked {asked[n]:,})' for n, k in list(more.items())[:WARNING_LINES_PER_CLASS])
        if len(more) > WARNING_LINES_PER_CLASS:
            extra += f', ... ({len(more):,} streams, {sum(more.values()):,} rows)'
        parts = [f'left out per epoch: {listing}'] if left else []
        if more:  # re-apportioning the lowered epoch_size rounds some streams up
            parts.append(f'taken beyond the weights per epoch: {extra}')
        notes.append(f'exact epoch: {epoch.epoch_size:,} rows = {epoch.epoch_size // G:,} whole '
                     f'global batches of {G} (the weights ask for {nominal:,}); {"; ".join(parts)} '
                     f'-- each stream\'s draws go on in the next epoch, so no row is lost '
                     f'to the cut, and none is trained twice to even out ranks')
    if config.batching_method == 'stratified':
        asked = epoch.chooses / epoch.epoch_size
        if np.abs(asked - epoch.shares).max() > 1e-6:
            per = ' + '.join(f'{n} {round(s * G)}' for n, s in zip(names, epoch.shares))
            warnings.append(
                f'stratified batching trains {per} rows of every global batch of {G} ('
                + ', '.join(f'{n} {s:.1%}' for n, s in zip(names, epoch.shares))
                + ' -- the shares shown), not the requested '
                + ', '.join(f'{n} {a:.1%}' for n, a in zip(names, asked)))


def under_one_pass_warnings(plans: list[StreamPlan],
                            limit: Optional[int] = WARNING_LINES_PER_CLASS) -> list[str]:
    """The streams seen under once per epoch: a line each, or past ``limit`` one line for the
    class (a line per stream of 1,000 would bury what matters)."""
    under = [s for s in plans if s.full_passes == 0]
    what = ('rows are not seen in an epoch (the next epoch goes on with the pass: every row is '
            'seen once before any is seen twice)')
    if limit is None or len(under) <= limit:
        return [f'{s.name}: under one pass ({s.passes:.3g}x): {s.unseen_rows:,} of {s.rows:,} {what}'
                for s in under]
    unseen, rows = sum(s.unseen_rows for s in under), sum(s.rows for s in under)
    worst = ', '.join(f'{s.name} {s.passes:.3g}x ({s.unseen_rows:,} of {s.rows:,} unseen)'
                      for s in sorted(under, key=lambda s: s.passes)[:limit])
    return [f'{len(under):,} streams under one pass: {unseen:,} of their {rows:,} {what}; '
            f'least seen: {worst} {EVERY_STREAM_HINT}']


def _stream_plans(infos: list[StreamInfo], epoch: _Epoch, L: int, warnings: list[str],
                  notes: list[str]) -> list[StreamPlan]:
    """Per-stream rows: passes, which rows repeat, tokens and shares."""
    plans = []
    for i, info in enumerate(infos):
        m = info.manifest
        n, choose = info.rows, int(epoch.chooses[i])
        full, extra = divmod(choose, n)
        uniform = m.counts.tokens == n * L and m.counts.loss_tokens == n * L
        ratio = choose / n
        plans.append(StreamPlan(
            name=info.name, kind=m.kind, rows=n, rows_per_epoch=choose, passes=ratio,
            full_passes=full, rows_seen_extra=extra, unseen_rows=n - extra if full == 0 else 0,
            share=float(epoch.shares[i]),
            trained_rows_per_epoch=int(epoch.trained[i]), slot_tokens_per_epoch=choose * L,
            tokens_per_epoch=m.counts.tokens * ratio,
            loss_tokens_per_epoch=m.counts.loss_tokens * ratio,
            tokens_exact=extra == 0 or uniform))
    warnings += under_one_pass_warnings(plans)
    total_tok = sum(s.tokens_per_epoch for s in plans) or 1.0
    total_loss = sum(s.loss_tokens_per_epoch for s in plans) or 1.0
    for s in plans:
        s.token_share = s.tokens_per_epoch / total_tok
        s.loss_token_share = s.loss_tokens_per_epoch / total_loss
    if not all(s.tokens_exact for s in plans):
        notes.append('~ marks expected token counts: a fractional pass trains the next rows of the '
                     'stream\'s current pass, so real/loss tokens vary slightly around this value')
    return plans


def plan_duration(plan: Plan, max_duration: Any, names: list[str], epoch: _Epoch,
                  stage_key: Optional[str] = None) -> DurationPlan:
    """Where ``max_duration`` ends, and exactly how many rows of each stream it trains: the one
    conversion of a duration to global batches (a stage's, at ``stage_key``, must be whole)."""
    key = stage_key or 'max_duration'
    time = parse_time(max_duration, key, DURATION_UNITS, positive=True)
    G, L, bpe = plan.global_batch_size, plan.max_seq_len, plan.batches_per_epoch
    if bpe <= 0:
        epoch_of = "the stage's epoch" if stage_key else 'the epoch'
        raise ConfigError(f'{key}: {epoch_of} ({plan.epoch_size:,} rows) holds no full global batch of {G} '
                          f'rows; add rows, raise the weights or lower the batch size')
    total_batches = to_batches(time, key, batches_per_epoch=bpe, samples_per_batch=G,
                               tokens_per_batch=G * L, round_up=stage_key is None)
    if stage_key:  # a stage states its length in batches
        time = parse_time(f'{total_batches}ba', key, DURATION_UNITS)
    full_epochs, rem = divmod(total_batches, bpe)
    totals = epoch.order.trained(total_batches)
    rows_trained = {n: int(v) for n, v in zip(names, totals)}
    passes = {n: rows_trained[n] / s.rows for n, s in zip(names, plan.streams)}
    if rem:
        last_epoch, last_batch = full_epochs, rem
    else:
        last_epoch, last_batch = full_epochs - 1, bpe
    return DurationPlan(
        max_duration=f'{time.value}{time.unit}', unit=UNIT_WORDS[time.unit], value=int(time.value),
        total_batches=total_batches, total_samples=total_batches * G,
        total_tokens=total_batches * G * L, epochs=total_batches / bpe, full_epochs=full_epochs,
        ends_mid_epoch=bool(rem), last_epoch=last_epoch, last_batch_in_epoch=last_batch,
        last_sample_in_epoch=last_batch * G,
        rows_per_stream=rows_trained, passes_per_stream=passes)

"""Stages (curricula): each stage's mixture, its exact length in batches, and the run's plan.
Every duration becomes whole global batches here, once, so a stage switches at one exact batch on
every rank and in a resumed run; a duration that is not whole batches is refused, not rounded."""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from foundrymix.config import DURATION_UNITS, ConfigError, parse_time
from foundrymix.plan.adaptive import AdaptiveSpec, adaptive_plan, adaptive_spec
from foundrymix.plan.catalog import Catalog, StreamInfo
from foundrymix.plan.config import LoaderConfig
from foundrymix.plan.mixture import RANK_COUNT_LIMIT, Plan, build_plan
from foundrymix.plan.order import WINDOW_ROWS, StageOrder, StreamDraws
from foundrymix.plan.topology import Topology
from foundrymix.plan.window import cache_window


#: the name of the one stage of a run without ``stages:`` (name it so to append stages to it)
MAIN_STAGE = 'main'


@dataclass
class StagePlan:
    """One stage: where it starts and ends in the run (global batches), its mixture, and all
    the loader is built from (config, metadata, plan, fingerprint), never recomputed there."""

    index: int
    name: str
    duration: str
    start_batch: int            # first global batch of the stage (0-based)
    batches: int
    plan: Plan                  # the stage's per-epoch mixture and its duration
    #: the stage's order: each stream's draws go on from where earlier stages left them (``start``)
    order: StageOrder = field(repr=False, compare=False)
    config: Optional[LoaderConfig] = field(default=None, repr=False, compare=False)
    infos: list[StreamInfo] = field(default_factory=list, repr=False, compare=False)
    fingerprint: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    where: str = 'train_loader'
    start_sample: int = 0       # rows trained before the stage (earlier stages' samples)
    adaptive: Optional[AdaptiveSpec] = field(default=None, repr=False, compare=False)
    #: (stream here, earlier adaptive stage, its stream there): draws decided during the run,
    #: which the loader adds to ``order.start`` (:meth:`~foundrymix.loader.position.StagedPosition.start`)
    after_adaptive: tuple[tuple[int, int, int], ...] = ()

    @property
    def end_batch(self) -> int:
        return self.start_batch + self.batches

    @property
    def global_batch_size(self) -> int:
        return self.plan.global_batch_size

    @property
    def batch_size(self) -> int:
        return self.plan.batch_size

    @property
    def samples(self) -> int:
        assert self.plan.duration is not None, 'a stage is planned with its duration'
        return self.plan.duration.total_samples

    @property
    def tokens(self) -> int:
        """Slot tokens (what a ``tok`` duration counts): samples x max_seq_len."""
        return self.samples * self.plan.max_seq_len

    @property
    def stream_names(self) -> list[str]:
        return [s.name for s in self.plan.streams]

    def to_dict(self) -> dict[str, Any]:
        keys = ('index', 'name', 'duration', 'start_batch', 'batches', 'end_batch', 'global_batch_size',
                'start_sample', 'samples', 'tokens')
        return {**{k: getattr(self, k) for k in keys}, 'plan': self.plan.to_dict()}


@dataclass
class RunPlan:
    """Every stage of a run, in order, and the rows each stream trains over the whole run:
    computed once (:func:`plan_run`), and what the CLI, the loader and a resume all read."""

    stages: list[StagePlan]
    global_batch_size: int      # the first stage's (each stage has its own: StagePlan)
    max_seq_len: int
    total_batches: int
    rows_per_stream: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    explicit: bool = True       # False: a single mixture (no ``stages:``), one stage
    #: adaptive stages whose rows per stream are decided during the run (not in rows_per_stream)
    decided_during_run: list[str] = field(default_factory=list)

    @property
    def stream_names(self) -> list[str]:
        """Run-wide stream index -> name: every stage's streams, in order of first use."""
        return list(dict.fromkeys(n for stage in self.stages for n in stage.stream_names))

    @property
    def total_samples(self) -> int:
        return sum(s.samples for s in self.stages)

    @property
    def total_tokens(self) -> int:
        return self.total_samples * self.max_seq_len

    @property
    def batch_sizes(self) -> list[int]:
        return [s.global_batch_size for s in self.stages]

    @property
    def batch_varies(self) -> bool:
        """True when stages have different global batches: the trainer then counts the run in samples."""
        return len(set(self.batch_sizes)) > 1

    def stage_at(self, batch: int) -> StagePlan:
        """The stage that trains global batch ``batch`` (0-based; past the end: the last)."""
        return next((s for s in self.stages if batch < s.end_batch), self.stages[-1])

    def to_dict(self) -> dict[str, Any]:
        keys = ('global_batch_size', 'max_seq_len', 'total_batches', 'total_samples', 'total_tokens',
                'batch_sizes', 'rows_per_stream', 'warnings', 'explicit')
        return {'stages': [s.to_dict() for s in self.stages], **{k: copy.copy(getattr(self, k)) for k in keys}}


def build_run_plan(config: LoaderConfig, infos: list[list[StreamInfo]], batch_size: int,
                   max_duration: Optional[str], topology: Topology = Topology(),
                   where: str = 'train_loader',
                   rank_count_limit: Optional[int] = RANK_COUNT_LIMIT) -> RunPlan:
    """The plan of a run: each stage planned once, with its own global batch, and the run totals.
    Without ``stages:`` the run is one stage, :data:`MAIN_STAGE`, as long as ``max_duration``."""
    configs = config.stage_configs(where)
    G = batch_size * topology.world_size
    if config.stages is None:  # max_duration given (DataConfig.check refuses a YAML without)
        specs = [(MAIN_STAGE, str(max_duration), where, G, None)]
    else:
        specs = [(s.name, s.duration, s.where, s.global_train_batch_size or G, f'{s.where}.duration')
                 for s in config.stages]
    stages: list[StagePlan] = []
    carried: dict[str, _Carried] = {}
    start = sample = 0
    for i, ((name, duration, at, stage_G, key), cfg, stage_infos) in enumerate(zip(specs, configs, infos)):
        if stage_G % topology.world_size:  # the words of plan.data_config.batch_per_rank
            raise ConfigError(f'{at}.global_train_batch_size={stage_G} is not divisible by '
                              f'the {topology.world_size} ranks')
        plan, order = build_plan(cfg, stage_infos, stage_G // topology.world_size, duration, topology,
                                 stage=name, rank_count_limit=rank_count_limit, stage_key=key)
        stages.append(_stage(i, name, duration, at, cfg, stage_infos, plan, order, start, sample, stage_G,
                             carried))
        start += stages[-1].batches
        sample += stages[-1].samples
    run = RunPlan(stages=stages, global_batch_size=stages[0].plan.global_batch_size,
                  max_seq_len=stages[0].plan.max_seq_len, total_batches=sum(s.batches for s in stages),
                  explicit=config.stages is not None,
                  decided_during_run=[s.name for s in stages if s.plan.duration.rows_per_stream is None])
    if max_duration is not None and run.explicit:
        _check_max_duration(max_duration, run)
    for stage in stages:
        for name, n in (stage.plan.duration.rows_per_stream or {}).items():
            run.rows_per_stream[name] = run.rows_per_stream.get(name, 0) + n
        run.warnings += [f'stage {stage.name}: {w}' if run.explicit else w for w in stage.plan.warnings]
    return run


def stream_location(info: StreamInfo) -> str:
    """What makes a stream the same in two stages, whatever its name: where its rows are."""
    return info.remote_dir or info.directory


#: a stream's draws, how many are known taken, and the (adaptive stage, stream)s that took more
_Carried = tuple[StreamDraws, int, tuple[tuple[int, int], ...]]


def _stage(index: int, name: str, duration: str, where: str, config: LoaderConfig,
           infos: list[StreamInfo], plan: Plan, order: StageOrder, start_batch: int,
           start_sample: int, G: int, carried: dict[str, _Carried]) -> StagePlan:
    """The stage, reading each stream from where earlier stages left its draws (``carried``,
    updated with this stage's); an adaptive stage's spec is built (and refused) here, once."""
    assert plan.duration is not None
    places = {stream_location(i): k for k, i in reversed(list(enumerate(infos)))}
    draws, start, after = list(order.draws), np.zeros(len(order.draws), np.int64), []
    for loc, k in places.items():
        if loc in carried:
            draws[k], start[k], deps = carried[loc]
            after += [(k, j, m) for j, m in deps]
    # the same positions and counts: only which rows fill them changes
    order = StageOrder(draws, order.counts, order.global_batch, order.key, order.shuffle, start)
    spec = adaptive_spec(config, where, name, plan, draws, start_batch, plan.duration.total_batches)
    if spec is not None:
        plan = adaptive_plan(plan, spec)
    rows = plan.duration.rows_per_stream
    for loc, k in places.items():
        deps = tuple((j, m) for here, j, m in after if here == k)
        carried[loc] = ((draws[k], int(start[k]) + rows[infos[k].name], deps) if rows is not None
                        else (draws[k], int(start[k]), deps + ((index, k),)))
    return StagePlan(index=index, name=name, duration=duration, start_batch=start_batch,
                     batches=plan.duration.total_batches, plan=plan, config=config, infos=infos, where=where,
                     start_sample=start_sample, order=order, adaptive=spec,
                     after_adaptive=tuple(after),
                     fingerprint=stage_fingerprint(config, infos, G, bool(after)))


def _check_max_duration(max_duration: str, run: RunPlan) -> None:
    time = parse_time(max_duration, 'max_duration', DURATION_UNITS, positive=True)
    value, unit = time.value, time.unit
    L, total = run.max_seq_len, run.total_batches
    samples = sum(s.batches * s.global_batch_size for s in run.stages)
    sums = {'ba': total, 'sp': samples, 'tok': samples * L}
    if unit == 'ep':
        raise ConfigError(f'max_duration: {max_duration} is ambiguous with stages (epochs of '
                          f'which stage?); leave it out (the run is the sum of the stages, '
                          f'{total}ba) or give {total}ba')
    if value != sums[unit]:
        raise ConfigError(f'max_duration: {max_duration} differs from the sum of the stages, '
                          f'{sums[unit]}{unit} ({total} batches); leave max_duration out or make '
                          f'them equal')


def plan_run(config: LoaderConfig, batch_size: int, max_duration: Optional[str] = None,
             topology: Optional[Topology] = None,
             where: str = 'train_loader', rank_count_limit: Optional[int] = RANK_COUNT_LIMIT
             ) -> tuple[RunPlan, list[Catalog]]:
    """Validate every stage and plan the run; returns the plan and each stage's catalog. The
    catalogs share one metadata cache: a stream several stages use is read (downloaded) once."""
    wheres = [where] if config.stages is None else [s.where for s in config.stages]
    shared: dict[Any, Any] = {}
    catalogs = [Catalog(c, w, shared) for c, w in zip(config.stage_configs(where), wheres)]
    lens = {c.where: c.max_seq_len for c in catalogs}  # each catalog validated, in order
    prints = {c.where: c.tokenizer.fingerprint for c in catalogs}
    if len(set(lens.values())) > 1 or len(set(prints.values())) > 1:
        listing = ', '.join(f'{w}: max_seq_len {lens[w]}, tokenizer {prints[w][:12]}' for w in lens)
        raise ConfigError(f'{where}.stages: stages disagree on max_seq_len or tokenizer ({listing})')
    return (build_run_plan(config, [c.infos() for c in catalogs], batch_size, max_duration,
                           topology or Topology(), where, rank_count_limit), catalogs)


def stage_fingerprint(config: LoaderConfig, infos: list[StreamInfo], global_batch_size: int,
                      after_adaptive: bool = False) -> dict[str, Any]:
    """What defines a stage's data, for the resume rules: streams, weights, knobs, indexes
    (compared field by field, so a refusal can name the stage, the stream and the field).
    ``after_adaptive``: a stream here continues a pass an adaptive stage decided at run time."""
    knobs = {k: getattr(config, k) for k in ('shuffle', 'shuffle_seed', 'shuffle_block_size',
                                             'batching_method', 'epoch_size')}
    if not config.shuffle_block_size and (window := cache_window(config, infos)) != WINDOW_ROWS:
        knobs['shuffle_block_size'] = window  # chosen to fit cache_limit: another order
    if config.weights_in != 'rows':  # only then: fingerprints of older checkpoints stay valid
        knobs['weights_in'] = config.weights_in
    if config.adaptive is not None:
        knobs['adaptive'] = config.adaptive.fingerprint()
    if after_adaptive:
        knobs['passes_after_adaptive'] = 'continue'
    streams = {}
    for info in infos:
        index = json.dumps(info.index.get('shards', []), sort_keys=True).encode('utf-8')
        streams[info.name] = {'directory': stream_location(info), 'repeat': info.spec.repeat,
                              'proportion': info.spec.proportion, 'choose': info.spec.choose,
                              'index': hashlib.sha256(index).hexdigest()[:16]}
    # the global batch, not the per-rank one: a resize keeps it and changes nothing trained
    return {'global_batch_size': global_batch_size, 'knobs': knobs, 'streams': streams}


#: knobs a fingerprint records only when not at their default (so older checkpoints match)
_OPTIONAL_KNOBS = {'weights_in': 'rows', 'adaptive': None, 'passes_after_adaptive': 'fresh'}


def fingerprint_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable differences between two stage fingerprints (empty if none)."""
    out = []
    if old.get('global_batch_size') != new['global_batch_size']:
        out.append(f'global batch size {old.get("global_batch_size")} -> '
                   f'{new["global_batch_size"]} (a trained stage\'s global_train_batch_size '
                   f'must stay fixed)')
    for key in dict.fromkeys([*old['knobs'], *new['knobs']]):
        value, now = (f['knobs'].get(key, _OPTIONAL_KNOBS.get(key)) for f in (old, new))
        if now != value:
            out.append(f'{key} {value!r} -> {now!r}')
    olds, news = old['streams'], new['streams']
    common = [n for n in olds if n in news]
    if common != [n for n in news if n in olds]:
        # streaming numbers samples stream by stream in config order: a new order is new data
        out.append(f'stream order {", ".join(common)} -> {", ".join(n for n in news if n in olds)}')
    for name in sorted(set(olds) | set(news)):
        if name not in news or name not in olds:
            out.append(f'stream {name} {"removed" if name in olds else "added"}')
            continue
        out += [f'stream {name}: {key} {value!r} -> {news[name].get(key)!r}'
                for key, value in olds[name].items() if news[name].get(key) != value]
    return out

"""``foundrymix plan CONFIG.yaml``: the exact mixture of a training YAML, from manifests only.

A YAML with trainer keys is read exactly as ``train`` reads it, so what ``train`` would refuse is
refused here in the same words; a data-only YAML is read by the core, importing no trainer or torch.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

from foundrymix.config import OVERRIDES_HELP, ConfigError
from foundrymix.heap import collector_paused


def plan_from_yaml(path: str, overrides: Sequence[str] = (), world_size: int = 1) -> Any:
    """The plan of a training YAML: a single mixture's :class:`~foundrymix.plan.mixture.Plan`, or a
    staged run's ``RunPlan`` -- from :func:`~foundrymix.plan.stages.plan_run`, the same function the
    trainer builds its loader from, so what is printed is what trains."""
    run, _ = _plan(path, overrides, world_size, None, 1)
    return run if run.explicit else run.stages[0].plan


@dataclass(frozen=True)
class EvalPlan:
    """One evaluation of the ``eval_loader``, as the trainer's evaluator reads it (whole global
    batches, at most ``eval_subset_num_batches``): the rows, the batches and the rows left out."""

    rows: int                  # rows in the eval set (after each stream's choose/proportion)
    rows_per_stream: dict[str, int]
    global_batch_size: int     # eval rows per batch over all ranks
    batches: int               # batches per evaluation
    rows_evaluated: int
    left_out_by_batches: int   # rows past the last whole global batch
    left_out_by_subset: int    # whole batches past eval_subset_num_batches

    def text(self) -> str:
        per_stream = ', '.join(f'{k} {v:,}' for k, v in self.rows_per_stream.items())
        line = (f'eval: {self.rows:,} rows ({per_stream}) in global batches of {self.global_batch_size:,}: '
                f'{self.batches:,} batches per evaluation, {self.rows_evaluated:,} rows evaluated; '
                f'{self.left_out_by_batches:,} left out by whole batches')
        if self.left_out_by_subset:
            line += f', {self.left_out_by_subset:,} more past eval_subset_num_batches'
        return line


def eval_plan(cfg: Any, world_size: int = 1, nodes: int = 1) -> Optional[EvalPlan]:
    """The eval set of a checked config on ``world_size`` ranks (None without ``eval_loader``)."""
    if cfg.eval_loader is None:
        return None
    from foundrymix.loader.mixer import StreamMixer
    from foundrymix.plan.data_config import batch_per_rank

    # a data-only YAML has no trainer keys: the trainer's defaults (the per-rank train batch, every batch)
    eval_batch = getattr(cfg, 'device_eval_batch_size', None) or batch_per_rank(cfg, world_size)
    plan = StreamMixer(cfg.eval_loader, 'eval_loader').plan(eval_batch, None, world_size, nodes)
    per_stream = dict(plan.nominal_rows_per_epoch)  # what the weights ask for, before whole batches
    whole = plan.batches_per_epoch
    subset = getattr(cfg, 'eval_subset_num_batches', -1)
    batches = whole if subset < 0 else min(whole, subset)
    gbs = plan.global_batch_size
    return EvalPlan(rows=sum(per_stream.values()), rows_per_stream=per_stream, global_batch_size=gbs,
                    batches=batches, rows_evaluated=batches * gbs,
                    left_out_by_batches=sum(plan.left_out_per_epoch.values()),
                    left_out_by_subset=(whole - batches) * gbs)


@collector_paused()  # as the trainer reads and plans a run (foundrymix/heap.py)
def _plan(path: str, overrides: Sequence[str], world_size: int, max_duration: Optional[str],
          nodes: int, rank_counts: bool = False) -> tuple[Any, Any]:
    """(the RunPlan, the config) of a YAML (:func:`_read`), refused as ``train`` refuses it."""
    from foundrymix.plan.catalog import Catalog
    from foundrymix.plan.data_config import (DataConfig, batch_per_rank, check_data_streams, check_eval_catalog,
                                             read_yaml_config)
    from foundrymix.plan.stages import RANK_COUNT_LIMIT, Topology, plan_run

    cfg = read_yaml_config(path, overrides, max_duration, _read)
    trainer = type(cfg) is not DataConfig
    if trainer:
        from foundrymix.train.config import check_streams, split_batch
        from foundrymix.train.preflight import check_start
        device_batch, _ = split_batch(cfg, world_size)
    else:
        device_batch = batch_per_rank(cfg, world_size)
    if world_size % nodes:
        raise ConfigError(f'world size {world_size} is not divisible by the {nodes} nodes')
    run, catalogs = plan_run(cfg.train_loader, device_batch, cfg.max_duration,
                             Topology(nodes=nodes, ranks_per_node=world_size // nodes),
                             rank_count_limit=None if rank_counts else RANK_COUNT_LIMIT)
    if trainer:
        check_start(cfg, run)  # what the trainer would refuse at start, as train refuses it
    for catalog in catalogs:  # as train refuses them
        (check_streams if trainer else check_data_streams)(cfg, catalog.max_seq_len, catalog.tokenizer)
    if cfg.eval_loader is not None:  # its streams, as train reads them
        check_eval_catalog(Catalog(cfg.eval_loader, 'eval_loader'), catalogs[0].max_seq_len,
                           catalogs[0].tokenizer)
    return run, cfg


def _read(data: dict[str, Any]) -> Any:
    """A data-only YAML as the core's ``DataConfig``; one with ``model:`` as ``train`` reads it
    (``TrainConfig``); one with other trainer keys but no model as a ``PlanConfig`` (every key
    checked as ``train`` would, the model left out)."""
    from foundrymix.plan.data_config import DATA_KEYS, DataConfig
    if DATA_KEYS.issuperset(data):
        return DataConfig.from_dict(data)
    from foundrymix.train.config import PlanConfig, TrainConfig
    return (TrainConfig if 'model' in data else PlanConfig).from_dict(data)


def _topology(args: argparse.Namespace) -> tuple[int, int]:
    """(world size, nodes) from ``--nodes``/``--ranks-per-node`` or ``--world-size`` (one node)."""
    if args.ranks_per_node is None:
        if args.nodes != 1 and args.world_size == 1:
            raise ConfigError('--nodes needs --ranks-per-node (or --world-size, the total ranks)')
        return args.world_size, args.nodes
    world = args.nodes * args.ranks_per_node
    if args.world_size not in (1, world):
        raise ConfigError(f'--world-size {args.world_size} differs from --nodes {args.nodes} x '
                          f'--ranks-per-node {args.ranks_per_node} = {world}')
    return world, args.nodes


@collector_paused()  # the output too: --json builds an object per stream and stage
def _run(args: argparse.Namespace) -> int:
    world, nodes = _topology(args)
    run, cfg = _plan(args.config, args.overrides, world, args.max_duration, nodes, args.rank_counts)
    plan = run if run.explicit else run.stages[0].plan
    schedule = lr = None  # the run's wsd schedule as the trainer's scheduler evaluates it (not Composer's)
    if getattr(cfg, 'scheduler', None) is not None and cfg.scheduler.name == 'wsd':
        from foundrymix.train.lr_schedule import resolve_wsd
        schedule, lr = resolve_wsd(cfg, run), cfg.optimizer.lr
    evals = eval_plan(cfg, world, nodes)
    if args.json:
        out = {**plan.to_dict(), **({} if evals is None else {'eval': asdict(evals)})}
        if schedule is not None:
            out['lr_schedule'] = schedule.to_dict(lr)
        print(json.dumps(out, indent=2))
    else:
        from foundrymix.tools.render import console_for_output, render_lr_schedule, render_plan, render_run_plan
        console = console_for_output()
        if getattr(cfg, 'model', None) is None:
            print('no model section: the data is planned; `foundrymix train` needs a model (and max_seq_len)')
        (render_run_plan if run.explicit else render_plan)(plan, console, all_streams=args.streams == 'all')
        if schedule is not None:
            render_lr_schedule(schedule, lr, console)
        if evals is not None:
            console.print(evals.text(), markup=False)
    if args.png:
        from foundrymix.train.picture import plot_run_plan
        plot_run_plan(run, args.png, lr=(schedule, lr) if schedule is not None else None)
        if not args.json:
            print(f'picture: {args.png}')
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        'plan', help='print the exact per-stream mixture and run length of a training YAML',
        description='Checks the whole training YAML as `foundrymix train` does (refusing what it '
                    'would refuse on --world-size ranks, with the same message), then reads only '
                    'manifests and index files (no shards): per stream the rows, rows per epoch, '
                    'passes, shares of rows/tokens/loss tokens; the epoch size; and where '
                    'max_duration ends.')
    p.add_argument('config', help='training YAML (the one `foundrymix train` runs)')
    p.add_argument('overrides', nargs='*',
                   help=f'{OVERRIDES_HELP}; put options such as --json before the config or '
                        'after the last override')
    p.add_argument('--json', action='store_true', help='print the plan as JSON')
    p.add_argument('--streams', choices=('summary', 'all'), default='summary',
                   help='beyond 20 streams the tables and lists show the largest and smallest '
                        'streams, the groups (name prefixes such as web/) and the totals, and a '
                        'per-stream warning becomes one line per kind; "all" lists every stream')
    p.add_argument('--world-size', type=int, default=1,
                   help='number of ranks (global_train_batch_size is split over them)')
    p.add_argument('--nodes', type=int, default=1,
                   help='number of nodes (machines); with --ranks-per-node the plan names every '
                        "rank's node and local rank")
    p.add_argument('--ranks-per-node', type=int, default=None,
                   help='ranks (GPUs) per node; world size = nodes x ranks per node')
    p.add_argument('--rank-counts', action='store_true',
                   help="count every rank's rows per stream in epoch 0 however large the epoch "
                        '(by default up to 50M rows an epoch: counting draws the stream of every '
                        'position, seconds per 10^8 rows)')
    p.add_argument('--max-duration', default=None,
                   help='override max_duration (3ep, 100ba, 5000sp, 1000tok)')
    p.add_argument('--png', default=None, metavar='FILE',
                   help='also draw the planned mixture over training steps (stages marked)')
    p.set_defaults(func=_run)

"""``foundrymix plan CONFIG.yaml``: the exact mixture of a training YAML, from manifests only.

The YAML is a full training config; only ``train_loader``, ``global_train_batch_size``
and ``max_duration`` are read (``variables`` and any other keys may be present and are
used only through omegaconf interpolation). ``key=value`` overrides use omegaconf
dotlist syntax, as the trainer does (``train_loader.shuffle_seed=3``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Optional, Sequence

from foundrymix.mix.config import ConfigError


def load_yaml(path: str, overrides: Sequence[str] = ()) -> Any:
    """Load ``path`` with omegaconf, merge ``key=value`` overrides, resolve interpolations."""
    import os

    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not os.path.isfile(path):
        raise FileNotFoundError(f'{path}: no such config file')
    try:
        cfg = OmegaConf.load(path)
        bad = [o for o in overrides if '=' not in o]
        if bad:
            raise ConfigError(f'override {bad[0]!r} is not key=value')
        if overrides:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f'{path}: {type(e).__name__}: {e}') from None
    except Exception as e:  # yaml.YAMLError and friends
        if type(e).__module__.startswith('yaml'):
            raise ConfigError(f'{path}: not valid YAML: {e}') from None
        raise


def plan_from_yaml(path: str, overrides: Sequence[str] = (), world_size: int = 1,
                   max_duration: Optional[str] = None) -> Any:
    """Build the :class:`~foundrymix.mix.plan.Plan` of a training YAML."""
    from foundrymix.mix.mixer import StreamMixer

    cfg = load_yaml(path, overrides)
    if not isinstance(cfg, dict) or 'train_loader' not in cfg:
        raise ConfigError(f'{path}: no train_loader section')
    gbs = cfg.get('global_train_batch_size')
    if not isinstance(gbs, int) or isinstance(gbs, bool) or gbs <= 0:
        raise ConfigError(f'{path}: global_train_batch_size must be a positive integer, '
                          f'got {gbs!r}')
    if gbs % world_size:
        raise ConfigError(f'global_train_batch_size {gbs} is not divisible by world size '
                          f'{world_size}')
    mixer = StreamMixer.from_dict(cfg['train_loader'], 'train_loader')
    duration = max_duration if max_duration is not None else cfg.get('max_duration')
    return mixer.plan(gbs // world_size, duration, world_size=world_size)


def _run(args: argparse.Namespace) -> int:
    plan = plan_from_yaml(args.config, args.overrides, args.world_size, args.max_duration)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        from rich.console import Console
        console = Console()
        if not console.is_terminal:
            console = Console(width=160)
        plan.render(console)
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        'plan', help='print the exact per-stream mixture and run length of a training YAML',
        description='Reads only manifests and index files (no shards): per stream the rows, rows '
                    'per epoch, passes, shares of rows/tokens/loss tokens; the epoch size; and '
                    'where max_duration ends.')
    p.add_argument('config', help='training YAML with a train_loader section')
    p.add_argument('overrides', nargs='*',
                   help='key=value overrides (omegaconf dotlist); put options such as --json '
                        'before the config or after the last override')
    p.add_argument('--json', action='store_true', help='print the plan as JSON')
    p.add_argument('--world-size', type=int, default=1,
                   help='number of ranks (global_train_batch_size is split over them)')
    p.add_argument('--max-duration', default=None,
                   help='override max_duration (Composer time string: 3ep, 100ba, 5000sp, 1000tok)')
    p.set_defaults(func=_run)

"""``foundrymix train CONFIG.yaml [key=value ...]`` (also ``train.py`` at the repo root)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser('train', help='train a causal LM on a stream mix with Composer',
                              description='Train a randomly initialised transformers causal LM on the '
                                          'mix a YAML describes. key=value arguments override the YAML.')
    p.add_argument('config', help='training YAML (see yamls/)')
    p.add_argument('overrides', nargs='*', metavar='key=value', help='omegaconf dotlist overrides')
    p.set_defaults(func=run_cli)


def print_summary(run) -> None:
    """Per-stream table of what was consumed against the plan, and where the report is."""
    from rich.console import Console
    from rich.table import Table

    summary = run.accounting.summary(run.trainer.state)
    table = Table(title=f'per-stream accounting after {summary["batch"]} batches '
                        f'({summary["epoch"]} full epochs)')
    for col in ('stream', 'samples', 'tokens', 'loss tokens', 'share', 'planned share'):
        table.add_column(col, justify='left' if col == 'stream' else 'right')
    for name, s in summary['streams'].items():
        table.add_row(name, f'{s["samples"]:,}', f'{s["tokens"]:,}', f'{s["loss_tokens"]:,}',
                      f'{s["share"]:.2%}', f'{s["planned_share"]:.2%}')
    console = Console()
    console.print(table)
    console.print(f'summary: {run.accounting.summary_path}')
    if run.accounting.plot:
        console.print(f'plot:    {run.accounting.plot_path}')
    if run.config.save_folder:
        console.print(f'checkpoints: {run.config.save_folder}')


def run_cli(args: argparse.Namespace) -> int:
    from foundrymix.train.builder import train
    from foundrymix.train.config import load_config

    cfg = load_config(args.config, args.overrides)
    run = train(cfg)
    from composer.utils import dist
    if dist.get_global_rank() == 0:
        print_summary(run)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    from foundrymix.cli import main as cli_main
    return cli_main(['train', *(sys.argv[1:] if argv is None else argv)])

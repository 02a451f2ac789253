"""``foundrymix train CONFIG.yaml [key=value ...]``, also ``python train.py`` / ``composer train.py``.

Both entry points call :func:`run_cli`. Imports of torch/composer wait until a run starts, so
registering the subcommand keeps ``foundrymix plan`` fast.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from foundrymix.config import OVERRIDES_HELP
from foundrymix.errors import Interrupted, UserError, run_command as run
from foundrymix.train.report import print_report

#: the one line ``foundrymix train`` prints where Composer is not installed (the core installs none)
COMPOSER_MISSING = ("training needs Composer, which is not installed here: pip install 'foundrymix[composer]' "
                    "(it pins torch <2.7.1 and numpy <2.3; convert, plan and the loader run without it)")

DESCRIPTION = ('Train a transformers causal LM on the mix a YAML describes: the weights of model.pretrained '
               '(a local directory; the run prints how many tensors it loaded) or a new model of model.type. '
               'key=value arguments override the YAML.')


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('config', help='training YAML (see yamls/)')
    parser.add_argument('overrides', nargs='*', metavar='key=value', help=OVERRIDES_HELP)
    parser.set_defaults(func=run_cli, command='train')


def register(subparsers: argparse._SubParsersAction) -> None:
    add_arguments(subparsers.add_parser('train', help='train a causal LM on a stream mix with Composer',
                                        description=DESCRIPTION))


def require_composer() -> None:
    """Refuse in one line, naming the extra, where ``composer`` is not installed (one that fails
    to import keeps its traceback, as a bug to report)."""
    try:
        import composer  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != 'composer':
            raise
        raise UserError(COMPOSER_MISSING) from None


def run_cli(args: argparse.Namespace) -> int:
    """Load the YAML (checked before Composer is looked for), build the trainer, fit; rank 0
    prints the accounting."""
    from foundrymix.train.config import load_config

    config = load_config(args.config, args.overrides)
    require_composer()
    from composer.utils import dist

    from foundrymix.train import interrupt
    from foundrymix.train.builder import train

    interrupt.install()  # after Composer's engine module installed its own handler
    try:
        run = train(config)
    except BaseException as e:
        if interrupt.received is None or isinstance(e, Interrupted):
            raise
        raise interrupt.stopped(config, None, dist.get_global_rank()) from None
    if dist.get_global_rank() == 0 and not run.finished:  # the per-stream table and where the report is
        from rich.console import Console
        console = Console()
        print_report(run.accounting.summary(run.trainer.state), run.accounting.out_dir, run.accounting.plot, console)
        if run.config.save_folder:
            console.print(f'checkpoints: {run.config.save_folder}')
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python train.py CONFIG [key=value ...]``: config errors exit 2 with one line, no traceback."""
    parser = argparse.ArgumentParser(prog='train.py', description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))

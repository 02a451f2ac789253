"""What a training run claims before it writes anything: its ``save_folder`` exclusively and
every local stream directory it reads as a reader (:mod:`foundrymix.claims`)."""

from __future__ import annotations

from typing import Any

from composer.utils import format_name_with_dist

from foundrymix import claims
from foundrymix.config import ConfigError
from foundrymix.train.config import TrainConfig


def claim_run(cfg: TrainConfig, held: claims.ClaimSet) -> None:
    """Claim, into ``held`` (the caller releases it, also on a refusal), all at once or none, what this
    run must not share: ``save_folder`` exclusively (an ``s3://`` one by its URL, on this machine), every
    local stream directory of every stage and of ``eval_loader`` as a reader (a ``convert --overwrite``
    would mix old and new rows). Taken before anything is written: a refused start changes nothing.
    """
    wanted: dict[tuple[str, str], Any] = {}  # (path, mode) -> the refusal's message(holders)
    if cfg.save_folder:
        folder = format_name_with_dist(cfg.save_folder, cfg.run_name)  # as Composer names it
        wanted[(claims.normalize(folder), claims.EXCLUSIVE)] = lambda who: (
            f'save_folder: {folder} is in use by another live run, {who}. Two runs saving into '
            f"one folder overwrite each other's checkpoints: give this run its own save_folder, "
            f'or wait for that run to end')
    for where, loader in (('train_loader', cfg.train_loader), ('eval_loader', cfg.eval_loader)):
        for stage in loader.stage_configs(where) if loader is not None else []:
            for name, spec in stage.streams.items():
                if spec.remote:
                    continue
                for path in dict.fromkeys((stage.stream_local(name), stage.stream_dir(name))):
                    wanted.setdefault((claims.normalize(path), claims.SHARED), lambda who, where=where, name=name, path=path: (
                        f'{where}.streams.{name}: {path} is held by another live run, {who} (a '
                        f'conversion replacing it, or a run writing there); reading it now would '
                        f'mix old and new rows. Wait for that run to end'))
    try:
        held.held.extend(claims.claim_all(wanted))
    except claims.Busy as e:
        raise ConfigError(wanted[(e.path, e.mode)](claims.describe(e.holders))) from None

"""``foundrymix export CHECKPOINT --to-hf DIR``: a Composer checkpoint as a transformers model.

Why: a run's checkpoints are Composer full-state files (weights under a ``model.``
prefix, optimizer, data position); everything downstream (evaluation harnesses,
``generate``, the Hub) wants a ``save_pretrained`` directory. The export rebuilds the
model from the transformers config the checkpoint recorded (the ``ModelInfo``
callback), loads the weights strictly (every tensor accounted for), writes
``config.json`` + ``model.safetensors``, and saves the tokenizer the streams were
converted with, after checking its fingerprint against the one recorded at training.

A model trained with ``attention: document`` is an ordinary causal LM; it reproduces
the training logits on packed rows when given the same restarting ``position_ids``, no
``attention_mask`` and ``use_cache=False`` (transformers 4.57 derives the block-diagonal
mask from position ids only without a KV cache; the exported config turns the cache
on for generation).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from foundrymix.errors import ExistsError, FoundrymixError, MissingError
from foundrymix.format.schema import MANIFEST_NAME
from foundrymix.format.shards import INDEX_NAME

PREFIX = 'model.'  # the CausalLM wrapper's attribute holding the transformers model


class ExportError(FoundrymixError, ValueError):
    """The checkpoint cannot be exported (what and why in the message)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser('export', help='write a checkpoint as a transformers model directory',
                              description='Write a Composer checkpoint of a foundrymix run as a Hugging Face '
                                          'model directory (config.json, model.safetensors, tokenizer), '
                                          'loadable offline with AutoModelForCausalLM/AutoTokenizer.from_pretrained.')
    p.add_argument('checkpoint', help='a Composer checkpoint file of a foundrymix run (e.g. latest-rank0.pt), '
                                      'or the folder holding them (its newest complete checkpoint is used)')
    p.add_argument('--to-hf', required=True, metavar='DIR', dest='out', help='output model directory')
    p.add_argument('--overwrite', action='store_true',
                   help='write into a non-empty DIR (never into a dataset directory)')
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    checkpoint = checkpoint_file(args.checkpoint, say=print)
    out = export_to_hf(checkpoint, args.out, overwrite=args.overwrite)
    print(f'exported {checkpoint} -> {out}')
    return 0


def checkpoint_file(path: str, say: Any = None) -> str:
    """``path`` itself, or for a folder of checkpoints (a run's ``save_folder``) its newest
    complete one (by batch; incomplete ones, left by a job killed while writing, are
    skipped), announced through ``say``; a folder with no checkpoint is refused, naming it."""
    if not os.path.isdir(path):
        return path
    from foundrymix.train.remote_resume import local_checkpoint

    try:
        found = local_checkpoint(path)
    except FoundrymixError:  # every checkpoint there is incomplete
        raise ExportError(f'{path}: every checkpoint in it is incomplete (written by a job killed while '
                          f'writing): nothing to export; give a complete checkpoint file') from None
    if found is None:
        raise MissingError(f'{path}: a directory without checkpoints (no ep<N>-ba<N>-rank0.pt or '
                           f'latest-rank0.pt in it); give a checkpoint file or the save_folder of a run')
    if say is not None:
        skipped = ''.join(f'; skipped {os.path.basename(p)} (incomplete: {why})' for p, why in found.skipped)
        say(f'{path} is a directory: exporting its newest complete checkpoint '
            f'{os.path.basename(found.path)}{skipped}')
    return found.path


def dataset_files(directory: str) -> list[str]:
    """The dataset files (``foundrymix.json``, MDS ``index.json``) in ``directory``."""
    return [n for n in (MANIFEST_NAME, INDEX_NAME) if os.path.isfile(os.path.join(directory, n))]


def load_checkpoint_state(path: str) -> dict[str, Any]:
    """The ``state`` of a (rank 0, unsharded) Composer checkpoint file."""
    return load_checkpoint(path)['state']


def load_checkpoint(path: str) -> dict[str, Any]:
    """A (rank 0, unsharded) Composer checkpoint file: ``state`` and ``rng`` (one per rank)."""
    import torch

    if not os.path.isfile(path):
        raise MissingError(f'{path}: no such checkpoint file')
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=False)
    except Exception as e:  # a tar of shards, a truncated file, not a checkpoint at all
        raise ExportError(f'{path}: not a Composer checkpoint file ({type(e).__name__}: {e})') from None
    if not isinstance(ckpt, dict) or 'state' not in ckpt or 'model' not in ckpt['state']:
        raise ExportError(f'{path}: not a Composer checkpoint (no state.model)')
    return ckpt


def model_info(state: dict[str, Any], path: str) -> dict[str, Any]:
    info = state.get('callbacks', {}).get('ModelInfo')
    if info is None:
        raise ExportError(f'{path}: the checkpoint has no ModelInfo record (written by a foundrymix older '
                          f'than export support); resume it for one step with this version to re-save it')
    return info


def hf_model_from_state(state: dict[str, Any], info: dict[str, Any]) -> Any:
    """The transformers model with the checkpoint's weights (strict: no tensor missing or extra)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config_dict = dict(info['hf_config'])
    config = CONFIG_MAPPING[config_dict['model_type']].from_dict(config_dict)
    config.use_cache = True  # training turned the KV cache off; generation wants it
    model = AutoModelForCausalLM.from_config(config)
    weights = {k[len(PREFIX):]: v for k, v in state['model'].items() if k.startswith(PREFIX)}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ExportError(f'checkpoint weights do not fit the recorded {config.model_type} config: '
                          f'missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}')
    return model


def find_tokenizer(info: dict[str, Any]) -> Any:
    """The streams' tokenizer (by its manifest name, else the pretrained model's directory);
    refuses one whose fingerprint differs from the one recorded at training."""
    from foundrymix.tokenizer import TokenizerError, load_tokenizer, tokenizer_info

    tried = []
    for name in (info['tokenizer'], info.get('pretrained')):
        if not name:
            continue
        try:
            tok = load_tokenizer(name)
        except TokenizerError as e:
            tried.append(f'{name!r}: {str(e).splitlines()[0]}')
            continue
        if tokenizer_info(tok).fingerprint == info['tokenizer_fingerprint']:
            return tok
        tried.append(f'{name!r}: another fingerprint')
    raise ExportError(f"no tokenizer with the fingerprint the run trained with "
                      f"({info['tokenizer_fingerprint'][:12]}): {'; '.join(tried)}")


def export_to_hf(checkpoint: str, out: str, overwrite: bool = False) -> str:
    """Write ``checkpoint`` as a transformers model directory ``out``; returns ``out``.

    A dataset directory is refused even with ``overwrite``: model files written among its
    shards would make it neither a dataset nor a model directory.
    """
    held = dataset_files(out) if os.path.isdir(out) else []
    if held:
        raise ExistsError(f'{out}: holds a dataset ({", ".join(held)}, {len(os.listdir(out))} entries); '
                          f'export writes model files, never into a dataset (not even with --overwrite): '
                          f'choose another --to-hf directory')
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ExistsError(f'{out}: exists and is not empty (use --overwrite)')
    state = load_checkpoint_state(checkpoint)
    info = model_info(state, checkpoint)
    model = hf_model_from_state(state, info)
    tokenizer = find_tokenizer(info)  # before writing anything
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out

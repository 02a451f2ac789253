"""``foundrymix export CHECKPOINT --to-hf DIR``: a Composer checkpoint as a ``save_pretrained``
directory: the model rebuilt from the config the checkpoint recorded (``ModelInfo``), its weights
loaded strictly, the streams' tokenizer saved beside it after its fingerprint is checked (docs/train.md).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from foundrymix.errors import ExistsError, FoundrymixError, MissingError
from foundrymix.format.schema import MANIFEST_NAME
from foundrymix.format.shards import INDEX_NAME
from foundrymix.tokenizer import TokenizerError, load_tokenizer, tokenizer_info

PREFIX = 'model.'  # the CausalLM wrapper's attribute holding the transformers model


class ExportError(FoundrymixError, ValueError):
    """The checkpoint cannot be exported (what and why in the message)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser('export', help='write a checkpoint as a transformers model directory, or a '
                                             'pretrain dataset as LLM-Foundry token shards',
                              description='Write a Composer checkpoint of a foundrymix run as a Hugging Face '
                                          'model directory (config.json, model.safetensors, tokenizer), '
                                          'loadable offline with AutoModelForCausalLM/AutoTokenizer.from_pretrained.')
    p.add_argument('checkpoint', help='a Composer checkpoint file of a foundrymix run (e.g. latest-rank0.pt), '
                                      'or the folder holding them (its newest complete checkpoint is used); '
                                      'with --to-foundry, a foundrymix pretrain dataset directory')
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument('--to-hf', metavar='DIR', dest='out', help='output model directory')
    to.add_argument('--to-foundry', metavar='DIR', help='write the dataset as MDS with one tokens column, as '
                                                        "LLM-Foundry's StreamingTextDataset reads it (a new DIR)")
    p.add_argument('--overwrite', action='store_true',
                   help='write into a non-empty DIR (never into a dataset directory)')
    p.add_argument('--adapter', action='store_true',
                   help='a LoRA run (model.peft_config): write only the adapter (adapter_config.json, '
                        'adapter_model.safetensors) for peft\'s PeftModel.from_pretrained over the base model '
                        'directory the run started from; without it a LoRA run is written merged')
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    if args.to_foundry is not None:
        from foundrymix.convert.adopt import export_to_foundry
        done = export_to_foundry(args.checkpoint, args.to_foundry)
        print(f'exported {args.checkpoint} -> {done.out}: {done.rows:,} rows, {done.tokens:,} tokens in '
              f"{done.shards} shard(s), one tokens column (LLM-Foundry's StreamingTextDataset)")
        return 0
    checkpoint = checkpoint_file(args.checkpoint)
    out = export_to_hf(checkpoint, args.out, overwrite=args.overwrite, adapter=args.adapter)
    print(f'exported {checkpoint} -> {out}')
    return 0


def checkpoint_file(path: str) -> str:
    """``path`` itself, or for a folder of checkpoints its newest complete one (printed); a folder
    with no checkpoint is refused, naming it."""
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
    skipped = ''.join(f'; skipped {os.path.basename(p)} (incomplete: {why})' for p, why in found.skipped)
    print(f'{path} is a directory: exporting its newest complete checkpoint '
          f'{os.path.basename(found.path)}{skipped}')
    return found.path


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


def hf_model_from_state(state: dict[str, Any], info: dict[str, Any]) -> Any:
    """The transformers model with the checkpoint's weights (strict: no tensor missing or extra);
    for a LoRA run (``info['peft']``) peft's LoRA model over it."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config_dict = dict(info['hf_config'])
    config = CONFIG_MAPPING[config_dict['model_type']].from_dict(config_dict)
    config.use_cache = True  # training turned the KV cache off; generation wants it
    model = AutoModelForCausalLM.from_config(config)
    weights = {k[len(PREFIX):]: v for k, v in state['model'].items() if k.startswith(PREFIX)}
    if info.get('peft') is not None:
        from foundrymix.train import lora
        if not lora.peft_available():
            raise ExportError(f'the checkpoint is of a LoRA run (model.peft_config): exporting it needs the '
                              f'peft library, which is not installed: {lora.INSTALL}')
        from peft import get_peft_model
        peft_config = lora.lora_config(info['peft'])
        peft_config.base_model_name_or_path = info.get('pretrained')  # the base the adapter's config names
        model = get_peft_model(model, peft_config)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ExportError(f'checkpoint weights do not fit the recorded {config.model_type} config: '
                          f'missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}')
    return model


def find_tokenizer(info: dict[str, Any]) -> Any:
    """The streams' tokenizer (by its manifest name, else the pretrained model's directory);
    refuses one whose fingerprint differs from the one recorded at training."""
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


def export_to_hf(checkpoint: str, out: str, overwrite: bool = False, adapter: bool = False) -> str:
    """Write ``checkpoint`` as a transformers model directory ``out``; returns ``out``. A LoRA run is
    written merged, or with ``adapter`` alone, only while the base directory holds, bitwise, the
    checkpoint's base weights. A dataset directory is refused even with ``overwrite``."""
    held = [n for n in (MANIFEST_NAME, INDEX_NAME) if os.path.isfile(os.path.join(out, n))]
    if held:
        raise ExistsError(f'{out}: holds a dataset ({", ".join(held)}, {len(os.listdir(out))} entries); '
                          f'export writes model files, never into a dataset (not even with --overwrite): '
                          f'choose another --to-hf directory')
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ExistsError(f'{out}: exists and is not empty (use --overwrite)')
    state = load_checkpoint(checkpoint)['state']
    info = state.get('callbacks', {}).get('ModelInfo')
    if info is None:
        raise ExportError(f'{checkpoint}: the checkpoint has no ModelInfo record (written by a foundrymix older '
                          f'than export support); resume it for one step with this version to re-save it')
    if adapter and info.get('peft') is None:
        raise ExportError(f'{checkpoint}: --adapter: the run trained every weight (no model.peft_config), '
                          f'so there is no adapter: export without --adapter')
    if adapter and not info.get('pretrained'):
        raise ExportError(f'{checkpoint}: --adapter: the run\'s base model was built at random (no '
                          f'model.pretrained), so an adapter alone has no base directory to load over: export '
                          f'without --adapter (the merged model)')
    model = hf_model_from_state(state, info)
    if adapter:
        _check_base(model, info['pretrained'])
    elif info.get('peft') is not None:
        model = model.merge_and_unload()  # W + scale * B @ A: an ordinary transformers model
    tokenizer = find_tokenizer(info)  # before writing anything
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _check_base(model: Any, directory: str) -> None:
    """The adapter is only right over the base it was trained on: every tensor of ``directory``'s
    safetensors weights must equal, bitwise, the LoRA ``model``'s base tensor of that name."""
    import torch
    from safetensors import safe_open

    from foundrymix.train.weights import safetensors_files

    if not os.path.isdir(directory):
        raise ExportError(f'--adapter: the base directory the run started from, {directory}, is gone: export '
                          f'without --adapter (the merged model), or restore the directory')
    files = safetensors_files(directory)
    if not files:
        raise ExportError(f'--adapter: {directory}: no safetensors weights to compare the base with: export '
                          f'without --adapter (the merged model)')
    mine = {key.removeprefix('base_model.model.').replace('.base_layer.', '.').replace('.original_module.', '.'): v
            for key, v in model.state_dict().items() if 'lora_' not in key and '.modules_to_save.' not in key}
    prefix = model.get_base_model().base_model_prefix
    for path in files:
        with safe_open(path, 'pt') as h:
            for key in h.keys():
                name = key if key in mine else f'{prefix}.{key}'
                if name in mine and torch.equal(h.get_tensor(key), mine[name]):
                    continue
                gone = '' if name in mine else ' (not in the model the adapter was trained on)'
                raise ExportError(f'--adapter: {path}: {key}{gone} differs from the base weights the adapter was '
                                  f'trained on (the directory changed since, or the run took only its config): '
                                  f'export without --adapter (the merged model)')

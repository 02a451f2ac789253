"""The Hugging Face ``Trainer`` on a foundrymix loader: :class:`FoundrymixTrainer` (``foundrymix[hf]``).

The loader is the whole run (stages, mixture, length from the YAML): the Trainer's data settings
agree with it or are refused, naming what to set instead. The loader's state travels in every
checkpoint (``foundrymix_loader.pt``) and resumes with it (the Trainer's own data skip is off: a
second skip would drop batches). Batch keys the model does not take never reach it.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import os
from typing import Any, Literal, Optional, Union

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME as TRAINER_STATE  # written after the model and optimizer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from foundrymix.config import ConfigError

#: the loader's state in each checkpoint directory
LOADER_STATE = 'foundrymix_loader.pt'


class FoundrymixTrainer(Trainer):
    """``transformers.Trainer`` that trains ``loader`` (from :func:`foundrymix.build_loader`). ``attention``:
    ``document`` (default) gives the model the packed rows' ``position_ids`` and no mask (it attends inside
    each document), ``causal`` the padding ``attention_mask``. Every other argument is the Trainer's."""

    def __init__(self, model: Any = None, args: Optional[TrainingArguments] = None, *, loader: Any,
                 attention: Literal['document', 'causal'] = 'document', **kwargs: Any) -> None:
        for key in ('train_dataset', 'data_collator'):
            if kwargs.get(key) is not None:
                raise ConfigError(f'FoundrymixTrainer: {key} is the loader\'s (its YAML\'s streams and '
                                  f'collation); leave {key} out')
        if attention not in ('document', 'causal'):
            raise ConfigError(f"FoundrymixTrainer: attention must be 'document' or 'causal', got {attention!r}")
        self.loader = loader
        self.attention = attention
        args = fit_arguments(args if args is not None else TrainingArguments(output_dir='trainer_output'), loader)
        callbacks = [*(kwargs.pop('callbacks', None) or []), _SaveLoaderState(loader)]
        super().__init__(model=model, args=args, callbacks=callbacks, **kwargs)
        self._model_keys = _model_keys(self.model, attention)
        self._no_cache = bool(_forward_takes(self.model, {'use_cache'}))

    def get_train_dataloader(self) -> Any:
        """The loader itself (accelerate passes it through; its rows are already this rank's)."""
        return self.loader

    def model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch keys the model's ``forward`` takes, and no cache (with one, transformers ignores
        ``position_ids`` building the mask: packed documents would attend to each other)."""
        inputs = {k: v for k, v in batch.items() if k in self._model_keys}
        if self._no_cache:
            inputs['use_cache'] = False
        return inputs

    def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        return super().compute_loss(model, self.model_inputs(inputs), *args, **kwargs)

    def train(self, resume_from_checkpoint: Optional[Union[str, bool]] = None, **kwargs: Any) -> Any:
        """Train from the loader's position; with ``resume_from_checkpoint`` (a directory, or ``True``:
        the newest in ``output_dir``) the loader resumes where it ended, checked against the step."""
        if resume_from_checkpoint is True:
            last = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
            if last is None:
                raise ConfigError(f'resume_from_checkpoint=True: no {PREFIX_CHECKPOINT_DIR}-N directory in '
                                  f'output_dir {self.args.output_dir!r}; start without resume_from_checkpoint')
            resume_from_checkpoint = last
        if resume_from_checkpoint:
            self.loader.load_state_dict(read_loader_state(str(resume_from_checkpoint),
                                                          self.args.gradient_accumulation_steps))
        return super().train(resume_from_checkpoint=resume_from_checkpoint or None, **kwargs)


def fit_arguments(args: TrainingArguments, loader: Any) -> TrainingArguments:
    """A copy of ``args`` fitted to ``loader`` (its length in optimizer steps, its per-rank batch, no
    data skip); a setting the loader decides is refused, naming the YAML key."""
    default = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    changed = {name for name in ('num_train_epochs', 'dataloader_num_workers', 'data_seed',
                                 'per_device_train_batch_size', 'max_steps')
               if getattr(args, name) != default[name]}
    problems = []
    if 'dataloader_num_workers' in changed:
        problems.append('dataloader_num_workers: the loader reads with its own workers: set '
                        'train_loader.num_workers in the YAML')
    if 'data_seed' in changed:
        problems.append('data_seed: the order is the loader\'s: set train_loader.shuffle_seed in the YAML')
    if 'num_train_epochs' in changed and args.num_train_epochs != 1:
        problems.append(f'num_train_epochs={args.num_train_epochs}: the loader is the whole run (its '
                        f'max_duration or stages, epochs included); leave num_train_epochs unset')
    batches = [stage.batch_size for stage in loader.plan.stages]
    if 'per_device_train_batch_size' in changed and set(batches) != {args.per_device_train_batch_size}:
        problems.append(f'per_device_train_batch_size={args.per_device_train_batch_size}: the loader '
                        f'gives each rank {"/".join(map(str, sorted(set(batches))))} rows '
                        f'(global_train_batch_size / ranks); leave it unset')
    ga = args.gradient_accumulation_steps
    steps = math.ceil(len(loader) / ga)
    if 'max_steps' in changed and args.max_steps > steps:
        problems.append(f'max_steps={args.max_steps}: the loader has {len(loader)} batches, '
                        f'{steps} optimizer steps at gradient_accumulation_steps={ga}; give the YAML a '
                        f'longer max_duration, or leave max_steps unset')
    if args.world_size != loader.world_size:
        problems.append(f'the Trainer runs on {args.world_size} process(es), the loader was built for '
                        f'{loader.world_size}: build it in each process with build_loader(config) (it '
                        f'reads RANK and WORLD_SIZE, as torchrun sets them)')
    if problems:
        raise ConfigError('FoundrymixTrainer: TrainingArguments ' + '; '.join(problems))
    fitted = copy.copy(args)
    fitted.per_device_train_batch_size = batches[0]
    fitted.num_train_epochs = 1
    fitted.max_steps = args.max_steps if 'max_steps' in changed else steps
    fitted.ignore_data_skip = True  # the loader's state resumes the data; HF's skip would skip again
    return fitted


def read_loader_state(checkpoint: str, accumulation: int) -> dict[str, Any]:
    """The loader state saved in ``checkpoint``, refused in one line when the checkpoint is
    incomplete or its step disagrees with the loader's batch."""
    path, trainer_state = os.path.join(checkpoint, LOADER_STATE), os.path.join(checkpoint, TRAINER_STATE)
    if not os.path.isfile(trainer_state) or not os.path.isfile(path):
        missing = TRAINER_STATE if not os.path.isfile(trainer_state) else LOADER_STATE
        raise ConfigError(f'resume_from_checkpoint={checkpoint!r}: no {missing} there (a checkpoint '
                          f'not written by FoundrymixTrainer, or one whose save was interrupted); '
                          f'resume from an earlier {PREFIX_CHECKPOINT_DIR}-N directory')
    from transformers import TrainerState
    step = TrainerState.load_from_json(trainer_state).global_step
    state = torch.load(path, weights_only=True)
    batch = state.get('batch') if isinstance(state, dict) else None
    if batch != step * accumulation:
        raise ConfigError(f'resume_from_checkpoint={checkpoint!r}: the loader stopped at global batch '
                          f'{batch}, the Trainer at step {step} x gradient_accumulation_steps '
                          f'{accumulation}; resume with the gradient_accumulation_steps the run had')
    return state


class _SaveLoaderState(TrainerCallback):
    """Writes the loader's state into each checkpoint just saved (the main process: every rank's
    loader is at the same global batch), beside and then renamed."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f'{PREFIX_CHECKPOINT_DIR}-{state.global_step}')
        if not os.path.isdir(folder):
            return
        path = os.path.join(folder, LOADER_STATE)
        torch.save(self.loader.state_dict(), path + '.tmp')
        os.replace(path + '.tmp', path)


def _model_keys(model: Any, attention: str) -> set[str]:
    """The batch keys the model is given: ids, labels, and ``position_ids`` (document) or
    ``attention_mask`` (causal) where its ``forward`` takes them."""
    keys = _forward_takes(model, {'input_ids', 'labels',
                                  'position_ids' if attention == 'document' else 'attention_mask'})
    if 'input_ids' not in keys:
        raise ConfigError(f'FoundrymixTrainer: the model\'s forward takes no input_ids '
                          f'({type(model).__name__}); it trains causal LMs that take input_ids and labels')
    return keys


def _forward_takes(model: Any, names: set[str]) -> set[str]:
    """Which of ``names`` the model's ``forward`` names; all of them for a wrapper (peft) whose
    forward hands its keyword arguments on."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return names
    named = {p.name for p in parameters if p.kind != p.VAR_KEYWORD}
    if 'input_ids' not in named and any(p.kind == p.VAR_KEYWORD for p in parameters):
        return names
    return names & named

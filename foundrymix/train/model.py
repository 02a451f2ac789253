"""A randomly initialised ``transformers`` causal LM wrapped as a Composer model.

Why our own small wrapper instead of ``composer.models.HuggingFaceModel``: foundrymix
batches carry bookkeeping keys (``stream_id``, ``sample_id``, ``sequence_id``) that a
Hugging Face model would reject, and the attention mode decides which of
``attention_mask``/``position_ids`` the model gets. Loss is the model's own
cross-entropy on ``labels`` (``-100`` ignored), so prompts, padding and packing seams
never contribute.

Attention modes (``model.attention``):

* ``document`` (default): tokens attend only inside their own document / packed
  example. We pass the per-segment ``position_ids`` and no 2D mask; transformers (4.57)
  derives a block-diagonal causal mask from restarting position ids. Padding tokens
  become one-token segments that attend only to themselves.
* ``causal``: plain causal attention over the whole row, padding masked.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from composer.metrics.nlp import LanguageCrossEntropy
from composer.models import ComposerModel

from foundrymix.schema import IGNORE_INDEX, TokenizerInfo
from foundrymix.train.model_spec import AttentionMode, ModelConfigError, ModelSpec

__all__ = ['AttentionMode', 'CausalLM', 'ModelConfigError', 'ModelSpec', 'build_hf_model']


def build_hf_model(spec: ModelSpec, tokenizer: TokenizerInfo, max_seq_len: int) -> torch.nn.Module:
    """Random-init causal LM from a config; refuse one that cannot hold the data."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(spec.config_kwargs)
    kwargs.setdefault('vocab_size', tokenizer.vocab_size)
    kwargs.setdefault('eos_token_id', tokenizer.eos_id)
    kwargs.setdefault('pad_token_id', tokenizer.pad_id)
    if tokenizer.bos_id is not None:
        kwargs.setdefault('bos_token_id', tokenizer.bos_id)
    kwargs.setdefault('use_cache', False)
    try:
        config = AutoConfig.for_model(spec.model_type, **kwargs)
    except (ValueError, TypeError) as e:
        raise ModelConfigError(f'model: {e}') from None
    if config.vocab_size < tokenizer.vocab_size:
        raise ModelConfigError(f'model.vocab_size={config.vocab_size} is smaller than the tokenizer '
                               f'vocabulary ({tokenizer.vocab_size}, {tokenizer.name})')
    for key in ('max_position_embeddings', 'n_positions'):
        positions = getattr(config, key, None)
        if positions is not None:
            if positions < max_seq_len:
                raise ModelConfigError(f'model.{key}={positions} does not fit max_seq_len={max_seq_len}')
            break
    if spec.attention == 'document':
        config._attn_implementation = 'sdpa'
    try:
        model = AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        raise ModelConfigError(f'model: {spec.model_type!r} is not a causal LM: {e}') from None
    return model


class CausalLM(ComposerModel):
    """Composer wrapper: forward on foundrymix batches, loss = HF loss on ``labels``."""

    def __init__(self, model: torch.nn.Module, attention: AttentionMode = 'document') -> None:
        super().__init__()
        self.model = model
        self.attention = attention
        self.train_metrics = {'LanguageCrossEntropy': LanguageCrossEntropy(ignore_index=IGNORE_INDEX)}
        self.val_metrics = {'LanguageCrossEntropy': LanguageCrossEntropy(ignore_index=IGNORE_INDEX)}

    def _model_inputs(self, batch: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        inputs: dict[str, Any] = {'input_ids': batch['input_ids'], 'labels': batch['labels'], 'use_cache': False}
        if self.attention == 'document':
            inputs['position_ids'] = batch['position_ids']
        else:
            inputs['attention_mask'] = batch['attention_mask']
        return inputs

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Any:
        return self.model(**self._model_inputs(batch))

    def loss(self, outputs: Any, batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return outputs.loss

    def eval_forward(self, batch: Mapping[str, torch.Tensor], outputs: Optional[Any] = None) -> Any:
        return outputs if outputs is not None else self.forward(batch)

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        return self.train_metrics if is_train else self.val_metrics

    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> None:
        # HF labels are unshifted: the logit at t predicts the label at t+1.
        metric.update(outputs.logits[:, :-1].contiguous(), batch['labels'][:, 1:].contiguous())

"""A ``transformers`` causal LM (random init or a local pretrained directory) as a Composer model.

Why not Composer's ``HuggingFaceModel``: batches carry bookkeeping keys (``stream_id``, ...) a
model would reject, and ``model.attention`` picks the inputs: ``document`` the per-segment
``position_ids`` and no mask (tokens attend inside their document, docs/gpu.md), ``causal`` the
padding ``attention_mask``. The loss is computed once per token with the per-row sums (:class:`RowLoss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from composer.metrics.nlp import LanguageCrossEntropy
from composer.models import ComposerModel
from torchmetrics import Metric

from foundrymix.format.schema import IGNORE_INDEX, TokenizerInfo
from foundrymix.train.model_spec import AttentionMode, ModelConfigError, ModelSpec, hf_config
from foundrymix.train.weights import check_weight_shapes
from foundrymix.train.flex import register
from foundrymix.train.fused_loss import fused_token_loss
from foundrymix.train.lora import wrap


def _check_fits(config: Any, tokenizer: TokenizerInfo, max_seq_len: int) -> None:
    if config.vocab_size < tokenizer.vocab_size:
        raise ModelConfigError(f'model.vocab_size={config.vocab_size} is smaller than the tokenizer '
                               f'vocabulary ({tokenizer.vocab_size}, {tokenizer.name})')
    for key in ('max_position_embeddings', 'n_positions'):
        positions = getattr(config, key, None)
        if positions is not None:
            if positions < max_seq_len:
                raise ModelConfigError(f'model.{key}={positions} does not fit max_seq_len={max_seq_len}')
            break


def build_hf_model(spec: ModelSpec, tokenizer: TokenizerInfo, max_seq_len: int) -> torch.nn.Module:
    """The causal LM: random init, or a local pretrained directory's weights (then it carries
    :func:`loading_line` as ``foundrymix_loading``); LoRA-wrapped with ``peft_config``. Refuses,
    before any weight loads, a model that cannot hold the data and weights unreadable or of other sizes."""
    from transformers import AutoModelForCausalLM

    config = hf_config(spec, tokenizer)
    _check_fits(config, tokenizer, max_seq_len)
    attn = spec.attn_implementation or 'sdpa'
    if attn == 'flex_attention':
        attn = register()
    if spec.pretrained is not None and spec.load_weights:  # (a folder without weights: config.check_streams)
        check_weight_shapes(spec, config)  # named, before transformers' tracebacks
    try:
        if spec.pretrained is not None and spec.load_weights:
            model, info = AutoModelForCausalLM.from_pretrained(
                spec.pretrained, config=config, local_files_only=True, attn_implementation=attn,
                dtype=torch.float32, output_loading_info=True)
            model.foundrymix_loading = loading_line(model, spec.pretrained, info['missing_keys'])
        else:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    except (ValueError, ImportError) as e:  # not a causal LM, flash-attn missing, ...
        raise ModelConfigError(f'model: {spec.model_type!r}: {e}') from None
    if spec.peft is not None:
        model = wrap(model, spec.peft)
    add_fsdp_hooks(model)
    return model


#: names of tensors left at init that the loading line lists before '... and K more'
MAX_NAMED_AT_INIT = 5


def loading_line(model: torch.nn.Module, directory: str, missing: list[str]) -> str:
    """``model: loaded N tensors from DIR (M left at init: names...)``, since transformers only
    logs missing weights. ``missing``: its ``output_loading_info`` list; N counts the model's
    own tensors (tied ones once, persistent buffers) less those."""
    own = [n for n, _ in model.named_parameters()]
    own += [n for n, _ in model.named_buffers()
            if n in model.state_dict(keep_vars=True)]  # persistent buffers only
    gone = set(missing)
    loaded = sum(1 for n in own if n not in gone)
    left = sorted(gone)
    if not left:
        return f'model: loaded {loaded} tensors from {directory} (none left at init)'
    named = ', '.join(left[:MAX_NAMED_AT_INIT])
    more = f' ... and {len(left) - MAX_NAMED_AT_INIT} more' if len(left) > MAX_NAMED_AT_INIT else ''
    return f'model: loaded {loaded} tensors from {directory} ({len(left)} left at init: {named}{more})'


def add_fsdp_hooks(model: torch.nn.Module) -> None:
    """Make Composer's FSDP shard (and activation-checkpoint) per transformer block, the classes of
    ``_no_split_modules``: without ``fsdp_wrap_fn`` it wraps only the whole model."""
    blocks = frozenset(getattr(model, '_no_split_modules', None) or ())

    def is_block(module: torch.nn.Module) -> bool:
        return type(module).__name__ in blocks

    model.fsdp_wrap_fn = is_block
    model.activation_checkpointing_fn = is_block


@dataclass(frozen=True)
class RowLoss:
    """Per row of a (micro)batch: the summed cross-entropy of its loss targets (detached float32)
    and their count (int64, ``labels[1:] != -100``), on the model's device."""

    loss_sum: torch.Tensor
    targets: torch.Tensor


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, RowLoss]:
    """The mean cross-entropy over loss targets, bitwise equal to transformers' ``ForCausalLMLoss``,
    and the :class:`RowLoss`, gathered without grad from the same ``log_softmax`` (no second one)."""
    logp = F.log_softmax(logits.float().reshape(-1, logits.shape[-1]), dim=-1)
    target = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1).to(logp.device)
    loss = F.nll_loss(logp, target, ignore_index=IGNORE_INDEX, reduction='mean')
    with torch.no_grad():
        scored = target != IGNORE_INDEX
        picked = logp.detach().gather(1, target.clamp(min=0)[:, None])[:, 0]
        per_token = torch.where(scored, -picked, torch.zeros_like(picked)).reshape(labels.shape)
        rows = RowLoss(loss_sum=per_token.sum(dim=-1), targets=scored.reshape(labels.shape).sum(dim=-1))
    return loss, rows


class RowLossMean(Metric):
    """The train ``LanguageCrossEntropy`` from the :class:`RowLoss` sums :meth:`CausalLM.loss`
    computed: Composer's metric would take a second cross-entropy over the whole logits (and
    ``fused_loss`` has none). Same value: the mean cross-entropy over loss targets."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state('sum_loss', default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx='sum')
        self.add_state('total_items', default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx='sum')

    def update(self, rows: RowLoss) -> None:
        self.sum_loss += rows.loss_sum.sum().to(self.sum_loss)
        self.total_items += rows.targets.sum().to(self.total_items)

    def compute(self) -> torch.Tensor:
        return (self.sum_loss / self.total_items.clamp(min=1)).float()


@dataclass
class HiddenStates:
    """A training forward's output with ``fused_loss``: the decoder's last hidden states, no logits."""

    hidden: torch.Tensor
    row_loss: Optional[RowLoss] = None


class CausalLM(ComposerModel):
    """Composer wrapper: forward on foundrymix batches (without ``labels``: no second loss), loss
    = the model's cross-entropy; :meth:`loss` and :meth:`eval_forward` leave ``outputs.row_loss``
    for stream accounting. With ``fused_loss`` a training forward stops at the hidden states and
    :meth:`loss` runs the output layer in chunks; evaluation keeps the logits."""

    def __init__(self, model: torch.nn.Module, attention: AttentionMode = 'document',
                 fused_loss: bool = False) -> None:
        super().__init__()
        self.model = model
        self.attention = attention
        self.fused_loss = fused_loss
        self.train_metrics = {'LanguageCrossEntropy': RowLossMean()}
        self.val_metrics = {'LanguageCrossEntropy': LanguageCrossEntropy(ignore_index=IGNORE_INDEX)}

    def _model_inputs(self, batch: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        inputs: dict[str, Any] = {'input_ids': batch['input_ids'], 'use_cache': False}
        if self.attention == 'document':
            inputs['position_ids'] = batch['position_ids']
        else:
            inputs['attention_mask'] = batch['attention_mask']
        return inputs

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Any:
        if self.fused_loss and self.training:
            return HiddenStates(self.model.base_model(**self._model_inputs(batch)).last_hidden_state)
        return self.model(**self._model_inputs(batch))

    def loss(self, outputs: Any, batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(outputs, HiddenStates):
            weight = self.model.get_output_embeddings().weight
            loss, sums, counts = fused_token_loss(outputs.hidden, weight, batch['labels'])
            outputs.row_loss = RowLoss(loss_sum=sums.detach(), targets=counts)
            return loss
        loss, outputs.row_loss = token_loss(outputs.logits, batch['labels'])
        return loss

    def eval_forward(self, batch: Mapping[str, torch.Tensor], outputs: Optional[Any] = None) -> Any:
        if outputs is None:
            outputs = self.forward(batch)
            with torch.no_grad():
                _, outputs.row_loss = token_loss(outputs.logits, batch['labels'])
        return outputs

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        return self.train_metrics if is_train else self.val_metrics

    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> None:
        if isinstance(metric, RowLossMean):
            metric.update(outputs.row_loss)
            return
        # HF labels are unshifted: the logit at t predicts the label at t+1.
        metric.update(outputs.logits[:, :-1].contiguous(), batch['labels'][:, 1:].contiguous())

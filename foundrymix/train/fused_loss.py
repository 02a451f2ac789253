"""``model.fused_loss: true``: the output layer and cross-entropy in chunks, never the ``tokens x vocab``
logits. Each chunk's logits live only inside :class:`LinearCrossEntropy`'s forward, which computes
the loss and the gradients (liger-kernel's approach, in plain torch); the loss is the full path's up
to float rounding. Only for ``model_spec.FUSED_TYPES`` (a plain ``lm_head``); not with FSDP1 or LoRA.
"""

from __future__ import annotations

from typing import Any

import torch

from foundrymix.format.schema import IGNORE_INDEX

#: logits held at once, per chunk (float32: 256 MiB)
CHUNK_ELEMENTS = 1 << 26


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


class LinearCrossEntropy(torch.autograd.Function):
    """``sum over scored tokens of -log softmax(hidden @ weight.T)[target]``, gradients computed in
    forward; returns the float32 sum (differentiable) and each token's loss (0 where ignored)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _compute_dtype(hidden)
        h, w = hidden.to(dtype), weight.to(dtype)
        n, vocab = h.shape[0], w.shape[0]
        chunk = max(1, CHUNK_ELEMENTS // vocab)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        per_token = torch.zeros(n, dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_grad else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_grad else None
        with torch.autocast(h.device.type, enabled=False):
            for start in range(0, n, chunk):
                hc, tc = h[start:start + chunk], target[start:start + chunk]
                logits = (hc @ w.T).float()
                scored = tc != IGNORE_INDEX
                safe = tc.clamp(min=0)
                lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, safe[:, None])[:, 0]
                per_token[start:start + chunk] = torch.where(scored, lse - picked, 0.0)
                if need_grad:
                    grad = torch.softmax(logits, dim=-1)
                    grad.scatter_add_(1, safe[:, None], torch.full_like(picked, -1.0)[:, None])
                    grad *= scored[:, None]
                    grad = grad.to(dtype)
                    grad_h[start:start + chunk] = grad @ w
                    grad_w += (grad.T @ hc).float()
        ctx.mark_non_differentiable(per_token)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return per_token.sum(), per_token

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, _grad_per_token: Any) -> tuple[Any, Any, None]:
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        gh = (grad_h * grad_loss).to(h_dtype) if ctx.needs_input_grad[0] else None
        gw = (grad_w * grad_loss).to(w_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None


def fused_token_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss over loss targets, per-row loss sums, per-row target counts) for ``(B, S, d)``
    hidden states and HF-style unshifted ``labels`` (the label at ``t+1`` is position ``t``'s target)."""
    target = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    flat = target.reshape(-1).to(hidden.device)
    loss_sum, per_token = LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, flat)
    scored = (flat != IGNORE_INDEX).reshape(labels.shape)
    count = scored.sum()
    loss = loss_sum / count.clamp(min=1)
    return loss, per_token.reshape(labels.shape).sum(dim=-1), scored.sum(dim=-1)

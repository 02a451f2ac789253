"""``attn_implementation: flex_attention``: document attention with PyTorch's FlexAttention, no dense
mask (transformers builds the ``BlockMask`` from restarting ``position_ids``). Our own attention
function compiles on CUDA only (transformers' always compiles, which fails on CPU), so the same path
is tested on CPU. Attention dropout, head masks, soft-capping and sinks are refused, not dropped.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

#: the name registered with transformers' AttentionInterface / AttentionMaskInterface
REGISTERED = 'foundrymix_flex'

#: FlexAttention's CUDA kernel (torch 2.11) refuses smaller query/key/value head dimensions
MIN_CUDA_HEAD_DIM = 16


@functools.lru_cache(maxsize=1)
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def flex_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, scaling: Optional[float] = None, dropout: float = 0.0,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``(B, H, S, D)`` in, ``(B, S, H, D)`` out."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if dropout and module.training:
        raise ValueError('attn_implementation flex_attention: attention dropout is not supported; '
                         'set the model config attention_dropout: 0')
    for name in ('head_mask', 's_aux', 'softcap'):
        if kwargs.get(name) is not None:
            raise ValueError(f'attn_implementation flex_attention: {name} is not supported by this model '
                             f'path; use attn_implementation sdpa')
    if attention_mask is not None and not isinstance(attention_mask, BlockMask):
        raise ValueError('attn_implementation flex_attention: expected a BlockMask from transformers')
    if query.is_cuda and query.shape[-1] < MIN_CUDA_HEAD_DIM:
        raise ValueError(f'attn_implementation flex_attention: the model\'s head dimension is {query.shape[-1]}; '
                         f'FlexAttention\'s GPU kernel needs at least {MIN_CUDA_HEAD_DIM} (hidden_size / '
                         f'num_attention_heads): use attn_implementation sdpa for this model')
    compiling = torch.compiler.is_compiling()
    kernel = _compiled_flex() if query.is_cuda and not compiling else flex_attention
    gqa = query.shape[1] != key.shape[1]
    out = kernel(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=1)
def trains_on_cpu() -> bool:
    """Whether this torch's FlexAttention has a backward on the CPU (torch 2.7 has; 2.11 refuses
    it at the forward of a tensor that needs a gradient), tried once on a 16 x 16 head."""
    from torch.nn.attention.flex_attention import flex_attention
    q = torch.zeros(1, 1, 16, 16, requires_grad=True)
    try:
        flex_attention(q, q, q).sum().backward()
    except NotImplementedError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def register() -> str:
    """Register :func:`flex_forward` and transformers' own FlexAttention mask builder under
    :data:`REGISTERED`; returns the name to give as ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flex_attention_mask

    AttentionInterface.register(REGISTERED, flex_forward)
    AttentionMaskInterface.register(REGISTERED, flex_attention_mask)
    return REGISTERED

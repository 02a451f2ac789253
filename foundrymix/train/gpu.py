"""GPU settings of a training YAML: ``fsdp`` (a typed copy of Composer's ``FSDPConfig``, checked
without importing torch; only the keys the YAML sets reach Composer) and ``compile_config``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, Optional

from foundrymix.config import ConfigError


@dataclass
class FSDPSettings:
    """``fsdp:`` -- Composer FSDP (``parallelism_config={'fsdp': ...}``); null keeps Composer's default."""

    sharding_strategy: Optional[Literal['FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD', 'HYBRID_SHARD',
                                        '_HYBRID_SHARD_ZERO2']] = None
    mixed_precision: Optional[Literal['DEFAULT', 'PURE', 'FULL']] = None
    state_dict_type: Optional[Literal['full', 'sharded']] = None
    activation_checkpointing: Optional[bool] = None
    activation_checkpointing_reentrant: Optional[bool] = None
    activation_cpu_offload: Optional[bool] = None
    cpu_offload: Optional[bool] = None
    auto_wrap: Optional[bool] = None
    backward_prefetch: Optional[Literal['BACKWARD_PRE', 'BACKWARD_POST', 'NONE']] = None
    forward_prefetch: Optional[bool] = None
    limit_all_gathers: Optional[bool] = None
    use_orig_params: Optional[bool] = None
    sync_module_states: Optional[bool] = None
    keep_low_precision_grads: Optional[bool] = None
    data_parallel_shard_degree: Optional[int] = None
    data_parallel_replicate_degree: Optional[int] = None
    load_monolith_rank0_only: Optional[bool] = None
    verbose: Optional[bool] = None

    def as_dict(self) -> dict[str, Any]:
        """Only the keys the YAML set (Composer fills in the rest)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass
class CompileSettings:
    """``compile_config:`` -- ``torch.compile`` of the model through Composer (LLM-Foundry's key);
    ``dynamic`` false: a run has one shape, compiled once (an eval batch of another size once more)."""

    mode: Optional[Literal['default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs']] = None
    dynamic: Optional[bool] = False
    fullgraph: bool = False
    backend: str = 'inductor'

    def as_dict(self) -> dict[str, Any]:
        """``torch.compile`` keyword arguments."""
        out = {'dynamic': self.dynamic, 'fullgraph': self.fullgraph, 'backend': self.backend}
        if self.mode is not None:
            out['mode'] = self.mode
        return out


def parallelism_config(fsdp: Optional[FSDPSettings], device: str) -> Optional[dict[str, Any]]:
    """Composer's ``parallelism_config`` for the ``fsdp`` section; FSDP needs GPUs."""
    if fsdp is None:
        return None
    if device != 'gpu':
        raise ConfigError(f'fsdp: FSDP runs on GPUs; this run is on device {device!r} '
                          f'(leave fsdp out, or set device: gpu)')
    return {'fsdp': fsdp.as_dict()}

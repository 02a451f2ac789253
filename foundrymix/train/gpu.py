"""GPU settings of a training YAML: ``fsdp`` (a typed copy of Composer's ``FSDPConfig``, or with
``version: 2`` of its ``FSDP2Config``, checked without importing torch; only the keys the YAML sets
reach Composer), ``compile_config`` and ``precision: amp_fp8`` (torchao's float8 linears).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, Optional

from foundrymix.config import ConfigError


@dataclass
class FSDPSettings:
    """``fsdp:`` -- Composer FSDP (``parallelism_config={'fsdp': ...}``); null keeps Composer's default.
    ``version: 2``: ``fully_shard`` (Composer's ``FSDP2Config``: its keys only, checkpoints ``full``
    unless ``state_dict_type`` says otherwise, as FSDP1's default)."""

    version: Optional[Literal[1, 2]] = None
    reshard_after_forward: Optional[bool] = None  # FSDP2 only (false: FSDP1's SHARD_GRAD_OP)

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
        """Only the keys the YAML set (Composer fills in the rest), ``version`` left out."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None and f.name != 'version'}


@dataclass
class CompileSettings:
    """``compile_config:`` -- ``torch.compile`` of the model through Composer (LLM-Foundry's key);
    ``dynamic`` false: a run has one shape, compiled once (an eval batch of another size once more)."""

    mode: Optional[Literal['default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs']] = None
    dynamic: Optional[bool] = False
    fullgraph: bool = False
    backend: str = 'inductor'

    def as_dict(self) -> dict[str, Any]:
        """``torch.compile`` keyword arguments (``mode`` only when set)."""
        return {k: v for k, v in asdict(self).items() if k != 'mode' or v is not None}


def parallelism_config(fsdp: Optional[FSDPSettings]) -> Optional[dict[str, Any]]:
    """Composer's ``parallelism_config`` for the ``fsdp`` section (off a GPU refused by
    :func:`foundrymix.train.preflight.check_start`)."""
    if fsdp is None:
        return None
    keys = fsdp.as_dict()
    if fsdp.version != 2:
        if 'reshard_after_forward' in keys:
            raise ConfigError('fsdp.reshard_after_forward: an FSDP2 key; add fsdp.version: 2, or give '
                              'sharding_strategy: SHARD_GRAD_OP (FSDP1)')
        return {'fsdp': keys}
    from composer.utils.parallelism import FSDP2Config

    fsdp1_only = sorted(set(keys) - FSDP2Config.settable_attrs())
    if fsdp1_only:
        raise ConfigError(f"fsdp.{fsdp1_only[0]}: an FSDP1 key, not one of FSDP2's (fsdp.version: 2): leave "
                          f"{', '.join(fsdp1_only)} out (FSDP2 always shards fully; reshard_after_forward: "
                          f"false keeps the parameters gathered between forward and backward)")
    return {'fsdp': FSDP2Config(**{'state_dict_type': 'full', **keys})}


def convert_to_fp8(model: Any) -> None:
    """``precision: amp_fp8``: every ``nn.Linear`` of the decoder (``model.base_model``; the output
    layer stays bf16, as torchtitan keeps it) becomes torchao's ``Float8Linear`` (dynamic per-tensor
    scales), through torchao's public API; the rest runs in ``amp_bf16``. Refusals: preflight."""
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model.base_model)


def cuda_capability() -> tuple[str, tuple[int, int]]:
    """This machine's first GPU: its name and CUDA compute capability."""
    import torch
    return torch.cuda.get_device_name(), torch.cuda.get_device_capability()


def fp8_problem(gpu: bool) -> Optional[str]:
    """Why ``precision: amp_fp8`` cannot run here, or None: on a GPU FP8 matmuls need CUDA compute
    capability >= 8.9 (Ada, Hopper); torchao's float8 module must import (missing, or built for
    another torch). A CPU is refused apart."""
    name, capability = cuda_capability() if gpu else ('', (9, 0))
    if capability < (8, 9):
        return (f'precision: amp_fp8 needs FP8 tensor cores (CUDA compute capability >= 8.9: H100, H200, '
                f'L4), and this GPU ({name}) is {capability[0]}.{capability[1]}: give precision: amp_bf16')
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        return (f"precision: amp_fp8 trains through torchao's float8 linears, and torchao does not import here "
                f"({str(e).splitlines()[0][:120]}): pip install 'foundrymix[fp8]' (or give precision: amp_bf16)")
    return None

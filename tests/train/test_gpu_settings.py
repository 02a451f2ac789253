"""GPU settings: the typed ``fsdp`` section, FSDP block wrapping, attention implementations.

What runs on CPU runs here (config, the ``parallelism_config`` handed to Composer, the
wrap functions, the refusals); the tests marked ``gpu`` need CUDA (and ``flash-attn``
for the varlen test) and are skipped without it.
"""

from __future__ import annotations

import dataclasses
import sys
import typing

import pytest
import torch
from helpers import tiny_run_config

from foundrymix.config import ConfigError
from foundrymix.format.schema import TokenizerInfo
from foundrymix.train.config import TrainConfig
from foundrymix.train.gpu import FSDPSettings, parallelism_config
from foundrymix.train.model import CausalLM, ModelSpec, build_hf_model

TOK = TokenizerInfo(name='t', vocab_size=64, fingerprint='f', bos_id=None, eos_id=0, pad_id=1, add_bos=False)
LLAMA = {'type': 'llama', 'hidden_size': 32, 'intermediate_size': 64, 'num_hidden_layers': 3,
         'num_attention_heads': 2, 'max_position_embeddings': 16}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')


def cfg_with(**top) -> TrainConfig:
    return TrainConfig.from_dict(tiny_run_config({'streams': {'a': {'local': '/x'}}}, global_train_batch_size=2,
                                                 max_duration='1ba', **top))


def test_every_fsdp_key_is_a_composer_fsdp_config_field_and_its_default_a_choice():
    from composer.utils.parallelism import FSDP2Config, FSDPConfig

    composer = {f.name: f for cls in (FSDP2Config, FSDPConfig) for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(FSDPSettings)
    for f in dataclasses.fields(FSDPSettings):
        if f.name == 'version':
            continue
        assert f.name in composer, f.name
        choices = [a for arg in typing.get_args(hints[f.name]) for a in typing.get_args(arg)]
        if choices:  # a Literal: Composer's own default must be one of ours
            assert composer[f.name].default in choices, f.name


def test_fsdp_section_is_typed_and_only_set_keys_reach_composer():
    cfg = cfg_with(fsdp={'sharding_strategy': 'SHARD_GRAD_OP', 'activation_checkpointing': True,
                         'mixed_precision': 'PURE'})
    assert parallelism_config(cfg.fsdp) == {'fsdp': {'sharding_strategy': 'SHARD_GRAD_OP',
                                                            'mixed_precision': 'PURE',
                                                            'activation_checkpointing': True}}
    assert parallelism_config(cfg_with().fsdp) is None


@pytest.mark.parametrize('fsdp, message', [
    ({'sharding_stratgy': 'FULL_SHARD'}, "fsdp: unknown key 'sharding_stratgy'"),
    ({'mixed_precision': 'FUL'}, "fsdp.mixed_precision: 'FUL' is not one of DEFAULT, PURE, FULL"),
    ({'cpu_offload': 'yes'}, "fsdp.cpu_offload: expected bool, got 'yes'"),
])
def test_fsdp_mistakes_are_refused(fsdp, message):
    with pytest.raises(ConfigError) as err:
        cfg_with(fsdp=fsdp)
    assert message in str(err.value)


def check_start_on_cpu(cfg: TrainConfig) -> None:
    """``check_start`` (the one refusal of FSDP off a GPU) of a one-stage run on ``device: cpu``."""
    from types import SimpleNamespace

    from foundrymix.train.preflight import check_start
    check_start(cfg, SimpleNamespace(stages=[], explicit=False))


def test_fsdp_on_cpu_is_refused_before_training():
    with pytest.raises(ConfigError) as err:
        check_start_on_cpu(cfg_with(fsdp={}, device='cpu'))
    assert str(err.value) == 'fsdp: FSDP runs on GPUs, and this run is on device: cpu: leave fsdp out'


def test_fsdp_version_2_hands_composer_an_fsdp2_config_of_the_set_keys():
    from composer.utils.parallelism import FSDP2Config

    cfg = cfg_with(fsdp={'version': 2, 'activation_checkpointing': True, 'reshard_after_forward': False})
    got = parallelism_config(cfg.fsdp)['fsdp']
    assert got == FSDP2Config(activation_checkpointing=True, reshard_after_forward=False, state_dict_type='full')
    sharded = parallelism_config(cfg_with(fsdp={'version': 2, 'state_dict_type': 'sharded'}).fsdp)
    assert sharded['fsdp'] == FSDP2Config(state_dict_type='sharded')
    assert parallelism_config(cfg_with(fsdp={'version': 1}).fsdp) == {'fsdp': {}}


@pytest.mark.parametrize('fsdp, message', [
    ({'version': 2, 'sharding_strategy': 'FULL_SHARD', 'use_orig_params': True},
     "fsdp.sharding_strategy: an FSDP1 key, not one of FSDP2's (fsdp.version: 2): leave sharding_strategy, "
     "use_orig_params out (FSDP2 always shards fully; reshard_after_forward: false keeps the parameters "
     "gathered between forward and backward)"),
    ({'reshard_after_forward': False},
     'fsdp.reshard_after_forward: an FSDP2 key; add fsdp.version: 2, or give sharding_strategy: SHARD_GRAD_OP '
     '(FSDP1)'),
])
def test_keys_of_the_other_fsdp_version_are_refused_in_one_line(fsdp, message):
    with pytest.raises(ConfigError) as err:
        parallelism_config(cfg_with(fsdp=fsdp).fsdp)
    assert str(err.value) == message
    with pytest.raises(ConfigError, match=r"^fsdp.version: 3 is not one of 1, 2"):
        cfg_with(fsdp={'version': 3})
    with pytest.raises(ConfigError, match='^fsdp: FSDP runs on GPUs'):
        check_start_on_cpu(cfg_with(fsdp={'version': 2}, device='cpu'))


def test_amp_fp8_is_refused_without_fp8_hardware_or_torchao(monkeypatch):
    """Each refusal one line naming the key and what to do: a GPU below capability 8.9 (the probe
    answering an A100), torchao not importable (blocked the way Python blocks an import); on an
    H100 with torchao importable the check passes."""
    from foundrymix.train import gpu as gpu_settings
    from foundrymix.train.gpu import fp8_problem

    monkeypatch.setattr(gpu_settings, 'cuda_capability', lambda: ('NVIDIA A100-SXM4-80GB', (8, 0)))
    assert fp8_problem(True) == ('precision: amp_fp8 needs FP8 tensor cores (CUDA compute capability >= 8.9: '
                                 'H100, H200, L4), and this GPU (NVIDIA A100-SXM4-80GB) is 8.0: give precision: '
                                 'amp_bf16')
    monkeypatch.setattr(gpu_settings, 'cuda_capability', lambda: ('NVIDIA H100 80GB HBM3', (9, 0)))
    if fp8_problem(True) is not None:
        pytest.skip(f'torchao does not import here: {fp8_problem(True)}')
    monkeypatch.setitem(sys.modules, 'torchao.float8', None)
    line = fp8_problem(True)
    assert line.startswith("precision: amp_fp8 trains through torchao's float8 linears, and torchao does not "
                           "import here (") and line.endswith("): pip install 'foundrymix[fp8]' (or give "
                                                             "precision: amp_bf16)")
    assert fp8_problem(False) == line and '\n' not in line


def test_amp_fp8_converts_the_decoder_linears_and_keeps_the_output_layer():
    pytest.importorskip('torchao.float8')
    from torchao.float8.float8_linear import Float8Linear

    from foundrymix.train.gpu import convert_to_fp8

    hf = build_hf_model(ModelSpec.from_dict(LLAMA), TOK, 16)
    linears = [n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear)]
    convert_to_fp8(hf)
    fp8 = [n for n, m in hf.named_modules() if isinstance(m, Float8Linear)]
    assert fp8 == [n for n in linears if n != 'lm_head'] and len(fp8) == 3 * 7
    assert type(hf.lm_head) is torch.nn.Linear


def test_fsdp_wraps_and_checkpoints_each_transformer_block():
    hf = build_hf_model(ModelSpec.from_dict(LLAMA), TOK, 16)
    wrapped = [name for name, m in hf.named_modules() if hf.fsdp_wrap_fn(m)]
    assert wrapped == ['model.layers.0', 'model.layers.1', 'model.layers.2']
    assert [n for n, m in hf.named_modules() if hf.activation_checkpointing_fn(m)] == wrapped


def test_flash_attention_without_the_package_is_a_config_error():
    try:
        import flash_attn  # noqa: F401
        pytest.skip('flash-attn is installed')
    except ImportError:
        pass
    with pytest.raises(ConfigError) as err:
        build_hf_model(ModelSpec.from_dict({**LLAMA, 'attn_implementation': 'flash_attention_2'}), TOK, 16)
    # transformers' own words: 4.x 'flash_attn seems to be not installed', 5.x 'the package for
    # FlashAttention2 doesn't seem to be installed'
    assert 'seem' in str(err.value) and 'installed' in str(err.value) and 'lash' in str(err.value)


def test_attn_implementation_is_checked():
    with pytest.raises(ConfigError) as err:
        ModelSpec.from_dict({**LLAMA, 'attn_implementation': 'flash'})
    assert str(err.value) == "model.attn_implementation: 'flash'; allowed: sdpa, eager, flash_attention_2, flex_attention"


def packed_batch(device: str) -> dict[str, torch.Tensor]:
    """Two rows of three packed documents each (restarting position ids)."""
    torch.manual_seed(1)
    ids = torch.randint(2, 64, (2, 16), device=device)
    pos = torch.tensor([list(range(5)) + list(range(7)) + list(range(4))] * 2, device=device)
    return {'input_ids': ids, 'labels': ids, 'position_ids': pos, 'attention_mask': torch.ones_like(ids)}


def test_sdpa_and_eager_agree_on_packed_documents():
    batch = packed_batch('cpu')
    torch.manual_seed(0)
    sdpa = CausalLM(build_hf_model(ModelSpec.from_dict(LLAMA), TOK, 16)).eval()
    eager = CausalLM(build_hf_model(ModelSpec.from_dict({**LLAMA, 'attn_implementation': 'eager'}), TOK, 16)).eval()
    eager.load_state_dict(sdpa.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(eager(batch).logits, sdpa(batch).logits, rtol=1e-5, atol=1e-5)


@gpu
def test_flash_attention_varlen_equals_sdpa_on_packed_documents():
    pytest.importorskip('flash_attn')
    batch = packed_batch('cuda')
    torch.manual_seed(0)
    sdpa = CausalLM(build_hf_model(ModelSpec.from_dict(LLAMA), TOK, 16)).cuda().to(torch.bfloat16).eval()
    flash = CausalLM(build_hf_model(ModelSpec.from_dict({**LLAMA, 'attn_implementation': 'flash_attention_2'}),
                                    TOK, 16)).cuda().to(torch.bfloat16).eval()
    flash.load_state_dict(sdpa.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(flash(batch).logits, sdpa(batch).logits, rtol=2e-2, atol=2e-2)


@gpu
@pytest.mark.slow
def test_fsdp_run_on_one_gpu_trains_and_exports(small_streams, tmp_path, process_group_ends):
    from foundrymix.cli import main as cli
    from foundrymix.train.builder import build_trainer

    loader = {'streams': {n: {'local': str(p)} for n, p in small_streams.items()}, 'num_workers': 0}
    cfg = TrainConfig.from_dict(tiny_run_config(
        loader, global_train_batch_size=4, max_duration='2ba', device='gpu', save_folder=str(tmp_path / 'ckpt'),
        save_interval='2ba', fsdp={'sharding_strategy': 'FULL_SHARD', 'state_dict_type': 'full'},
        callbacks={'stream_accounting': {'out_dir': str(tmp_path / 'report'), 'plot': False}}))
    run = build_trainer(cfg)
    assert run.trainer.state.fsdp_enabled
    run.trainer.fit()
    run.trainer.close()
    assert cli(['export', str(tmp_path / 'ckpt' / 'latest-rank0.pt'), '--to-hf', str(tmp_path / 'hf')]) == 0

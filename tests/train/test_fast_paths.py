"""The GPU fast paths, checked where they run: FlexAttention, the fused output layer + loss, compile.

* ``attn_implementation: flex_attention`` against ``sdpa`` with transformers' dense
  block-diagonal mask (logits and every gradient), and against each document run alone;
* ``fused_loss: true`` against transformers' own loss (``labels=``) for every model type it
  allows, in fp32 and under bf16 autocast, gradients included;
* a real run with both (and with ``compile_config`` where it compiles) counts exactly what
  the plain run counts, per stream, with the same losses;
* the refusals name the key. CUDA variants are marked ``gpu`` and skipped without one.
"""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_run_config

from foundrymix.config import ConfigError
from foundrymix.format.schema import TokenizerInfo
from foundrymix.train.config import TrainConfig
from foundrymix.train.flex import trains_on_cpu
from foundrymix.train.model_spec import FUSED_TYPES
from foundrymix.train.model import CausalLM, ModelSpec, build_hf_model

TOK = TokenizerInfo(name='t', vocab_size=64, fingerprint='f', bos_id=None, eos_id=0, pad_id=1, add_bos=False)
SEQ = 48
LLAMA = {'type': 'llama', 'hidden_size': 32, 'intermediate_size': 64, 'num_hidden_layers': 2,
         'num_attention_heads': 4, 'num_key_value_heads': 2, 'max_position_embeddings': SEQ}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
#: documents of each row (lengths), then padding: one-token segments at position 0
DOCS = [[20, 28], [7, 30, 5]]


def packed_batch(device: str = 'cpu') -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(2, 64, (len(DOCS), SEQ))
    pos = torch.zeros_like(ids)
    for r, lengths in enumerate(DOCS):
        pos[r, :sum(lengths)] = torch.cat([torch.arange(n) for n in lengths])
    labels = ids.clone()
    labels[1, 42:] = -100  # padding
    labels[0, :6] = -100   # a prompt
    return {k: v.to(device) for k, v in
            {'input_ids': ids, 'labels': labels, 'position_ids': pos, 'attention_mask': torch.ones_like(ids)}.items()}


def pair(spec: dict, other: dict, device: str = 'cpu', fused: bool = False) -> tuple[CausalLM, CausalLM]:
    torch.manual_seed(0)
    a = CausalLM(build_hf_model(ModelSpec.from_dict(spec), TOK, SEQ)).to(device)
    b = CausalLM(build_hf_model(ModelSpec.from_dict({**spec, **other}), TOK, SEQ), fused_loss=fused).to(device)
    b.load_state_dict(a.state_dict())
    return a, b


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_flex_attention_equals_sdpa_with_the_dense_mask_logits_and_gradients():
    batch = packed_batch()
    sdpa, flex = pair(LLAMA, {'attn_implementation': 'flex_attention'})
    if not trains_on_cpu():  # this torch (2.11) has no CPU backward, as the probe says (refused at start)
        with pytest.raises(NotImplementedError):
            flex(batch)
        with torch.no_grad():
            torch.testing.assert_close(flex(batch).logits, sdpa(batch).logits, rtol=1e-5, atol=1e-5)
        return
    out_s, out_f = sdpa(batch), flex(batch)
    torch.testing.assert_close(out_f.logits, out_s.logits, rtol=1e-5, atol=1e-5)
    sdpa.loss(out_s, batch).backward()
    flex.loss(out_f, batch).backward()
    g_s, g_f = grads(sdpa), grads(flex)
    assert g_s.keys() == g_f.keys() and len(g_s) == len(list(sdpa.parameters()))
    for name in g_s:
        torch.testing.assert_close(g_f[name], g_s[name], rtol=1e-4, atol=1e-6, msg=name)


def test_flex_attention_sees_only_its_own_document():
    """Each packed document's logits equal those of the document run alone (an oracle without masks)."""
    batch = packed_batch()
    _, flex = pair(LLAMA, {'attn_implementation': 'flex_attention'})
    flex.eval()
    with torch.no_grad():
        packed = flex(batch).logits
        for r, lengths in enumerate(DOCS):
            start = 0
            for n in lengths:
                alone = flex.model(input_ids=batch['input_ids'][r:r + 1, start:start + n]).logits[0]
                torch.testing.assert_close(packed[r, start:start + n], alone, rtol=1e-5, atol=1e-5)
                start += n


def model_spec(model_type: str) -> dict:
    return {**LLAMA, 'type': model_type}


@pytest.mark.parametrize('model_type', FUSED_TYPES)
def test_fused_loss_equals_transformers_own_loss_and_gradients(model_type):
    batch = packed_batch()
    full, fused = pair(model_spec(model_type), {'fused_loss': True}, fused=True)
    # transformers' own loss, computed by the model from labels=: the independent reference
    own = full.model(input_ids=batch['input_ids'], position_ids=batch['position_ids'], labels=batch['labels']).loss
    out = fused(batch)
    assert out.__class__.__name__ == 'HiddenStates'  # no logits were made
    loss = fused.loss(out, batch)
    torch.testing.assert_close(loss, own, rtol=1e-6, atol=1e-6)
    plain_out = full(batch)
    full.loss(plain_out, batch).backward()
    loss.backward()
    torch.testing.assert_close(out.row_loss.loss_sum, plain_out.row_loss.loss_sum, rtol=1e-6, atol=1e-5)
    assert torch.equal(out.row_loss.targets, plain_out.row_loss.targets)
    assert out.row_loss.targets.tolist() == [SEQ - 6, 41]  # row 0: labels 6..47; row 1: labels 1..41
    g_full, g_fused = grads(full), grads(fused)
    assert g_full.keys() == g_fused.keys()
    for name in g_full:
        torch.testing.assert_close(g_fused[name], g_full[name], rtol=1e-4, atol=1e-6, msg=name)


def test_fused_loss_under_bf16_autocast_matches_the_full_path():
    batch = packed_batch()
    full, fused = pair(LLAMA, {'fused_loss': True}, fused=True)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        a = full.loss(full(batch), batch)
        b = fused.loss(fused(batch), batch)
    torch.testing.assert_close(b, a, rtol=2e-3, atol=2e-3)
    a.backward()
    b.backward()
    for name, g in grads(full).items():
        torch.testing.assert_close(grads(fused)[name], g, rtol=5e-2, atol=2e-3, msg=name)


def test_evaluation_keeps_the_logits_with_fused_loss():
    batch = packed_batch()
    full, fused = pair(LLAMA, {'fused_loss': True}, fused=True)
    full.eval()
    fused.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused.eval_forward(batch).logits, full.eval_forward(batch).logits)


def run_streams(small_streams, tmp_path, name: str, **model) -> tuple[dict, dict]:
    from foundrymix.train.builder import build_trainer

    loader = {'streams': {n: {'local': str(p)} for n, p in small_streams.items()}, 'shuffle': True,
              'shuffle_seed': 3, 'num_workers': 0}
    top = {'device': 'cpu', **model.pop('top', {})}  # the CPU unless a test asks for the GPU
    base = tiny_run_config(loader)['model']
    cfg = TrainConfig.from_dict(tiny_run_config(
        loader, global_train_batch_size=4, max_duration='4ba', model={**base, **model},
        callbacks={'stream_accounting': {'out_dir': str(tmp_path / name), 'plot': False}}, **top))
    run = build_trainer(cfg)
    try:
        run.trainer.fit()
        weights = {k: v.detach().clone() for k, v in run.trainer.state.model.state_dict().items()}
        return run.accounting.streams(), weights
    finally:
        run.trainer.close()
        run.claims.release()


@pytest.mark.slow
def test_a_run_with_flex_and_fused_loss_counts_what_the_plain_run_counts(small_streams, tmp_path):
    if not trains_on_cpu():
        pytest.skip(f'torch {torch.__version__} has no FlexAttention backward on the CPU (refused at start)')
    plain, w_plain = run_streams(small_streams, tmp_path, 'plain')
    fast, w_fast = run_streams(small_streams, tmp_path, 'fast', attn_implementation='flex_attention',
                               fused_loss=True)
    assert plain.keys() == fast.keys()
    for name in plain:
        for key in ('samples', 'tokens', 'loss_tokens', 'loss_targets'):
            assert fast[name][key] == plain[name][key], (name, key)
        assert fast[name]['loss'] == pytest.approx(plain[name]['loss'], rel=1e-5)
    for key in w_plain:
        off = ((w_fast[key] - w_plain[key]).abs() > 1e-4).sum().item()
        # Adam turns a float-rounding-sized gradient of an embedding row no token used into a
        # whole step; every other weight stays within 1e-4
        assert off <= (2 if 'embed_tokens' in key else 0), (key, off)


@pytest.mark.parametrize('model, message', [
    ({'type': 'gpt2', 'fused_loss': True}, "model.fused_loss: not checked for a 'gpt2' model"),
    ({**LLAMA, 'fused_loss': 'yes'}, "model.fused_loss: 'yes'; write true or false"),
    ({**LLAMA, 'fused_loss': True, 'peft_config': {'r': 4, 'target_modules': ['q_proj']}},
     'model.fused_loss: not with peft_config'),
    ({**LLAMA, 'attn_implementation': 'flexattention'}, "model.attn_implementation: 'flexattention'; allowed:"),
])
def test_fast_path_mistakes_are_refused_naming_the_key(model, message):
    pytest.importorskip('peft')
    with pytest.raises(ConfigError, match=message.replace('(', r'\(').replace('[', r'\[')):
        ModelSpec.from_dict(model)


class FakeRun:
    """What check_start reads of a run plan to convert max_duration (here: nothing; given in ba)."""

    stages: list = []
    explicit = False


def test_fused_loss_with_fsdp_and_a_bad_compile_mode_are_refused():
    from foundrymix.train.preflight import check_start

    loader = {'streams': {'a': {'local': '/x'}}}
    cfg = TrainConfig.from_dict(tiny_run_config(loader, global_train_batch_size=2, max_duration='1ba',
                                                model={**LLAMA, 'fused_loss': True}, device='gpu',
                                                fsdp={'sharding_strategy': 'FULL_SHARD'}))
    with pytest.raises(ConfigError) as err:
        check_start(cfg, FakeRun())
    assert str(err.value) == ("model.fused_loss: not with FSDP1 (the output layer would run outside FSDP's "
                              "forward): give fsdp.version: 2 (fully_shard), or leave fused_loss out")
    # FSDP2 (fully_shard) takes the fused loss
    v2 = TrainConfig.from_dict(tiny_run_config(loader, global_train_batch_size=2, max_duration='1ba',
                                               model={**LLAMA, 'fused_loss': True}, device='gpu',
                                               fsdp={'version': 2}))
    assert check_start(v2, FakeRun()) == ('1ba', '0ba')
    auto = TrainConfig.from_dict(tiny_run_config(loader, global_train_batch_size=2, max_duration='1ba', device='gpu',
                                                 fsdp={'version': 2}, device_train_microbatch_size='auto'))
    with pytest.raises(ConfigError) as err:
        check_start(auto, FakeRun())
    assert str(err.value) == ("device_train_microbatch_size: auto is not with fsdp.version: 2 (Composer's FSDP2 "
                              "does not fit the microbatch): give a whole number that divides the per-rank batch")
    with pytest.raises(ConfigError, match="compile_config.mode: 'max_autotune' is not one of"):
        TrainConfig.from_dict(tiny_run_config(loader, global_train_batch_size=2, max_duration='1ba',
                                              compile_config={'mode': 'max_autotune'}))


def test_compile_mode_reduce_overhead_is_handed_to_composer_as_given():
    """CUDA graphs for small models: the mode is handed to Composer's ``compile_config`` as given."""
    cfg = TrainConfig.from_dict(tiny_run_config({'streams': {'a': {'local': '/x'}}}, global_train_batch_size=2,
                                                max_duration='1ba', compile_config={'mode': 'reduce-overhead'}))
    assert cfg.compile_config.as_dict() == {'dynamic': False, 'fullgraph': False, 'backend': 'inductor',
                                            'mode': 'reduce-overhead'}


@pytest.mark.slow
def test_a_compiled_run_counts_what_the_plain_run_counts_and_compiles_once(small_streams, tmp_path):
    import torch._dynamo
    from torch._dynamo.utils import counters  # dynamo's own count

    plain, _ = run_streams(small_streams, tmp_path, 'plain')
    torch._dynamo.reset()
    counters.clear()
    compiled, _ = run_streams(small_streams, tmp_path, 'compiled', fused_loss=True, top={'compile_config': {}})
    # one graph for the whole training forward: nothing recompiled, no graph break
    assert counters['stats']['unique_graphs'] == 1
    assert not counters['recompiles'] and not counters['graph_break']
    for name in plain:
        for key in ('samples', 'tokens', 'loss_tokens', 'loss_targets'):
            assert compiled[name][key] == plain[name][key], (name, key)
        assert compiled[name]['loss'] == pytest.approx(plain[name]['loss'], rel=1e-4)


@gpu
def test_flex_attention_on_cuda_equals_sdpa_within_bf16():
    batch = packed_batch('cuda')
    wide = {**LLAMA, 'hidden_size': 64}  # head dimension 16: the least FlexAttention's GPU kernel takes
    sdpa, flex = pair(wide, {'attn_implementation': 'flex_attention'}, device='cuda')
    with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16):
        torch.testing.assert_close(flex(batch).logits, sdpa(batch).logits, rtol=2e-2, atol=2e-2)
    _, narrow = pair(LLAMA, {'attn_implementation': 'flex_attention'}, device='cuda')
    with pytest.raises(ValueError, match="head dimension is 8; FlexAttention's GPU kernel needs at least 16"):
        narrow(batch)


@gpu
def test_fused_loss_on_cuda_equals_the_full_path_within_bf16():
    batch = packed_batch('cuda')
    full, fused = pair(LLAMA, {'fused_loss': True}, device='cuda', fused=True)
    with torch.autocast('cuda', dtype=torch.bfloat16):
        a_out, b_out = full(batch), fused(batch)
        a, b = full.loss(a_out, batch), fused.loss(b_out, batch)
    torch.testing.assert_close(b, a, rtol=2e-3, atol=2e-3)
    assert torch.equal(b_out.row_loss.targets, a_out.row_loss.targets)
    a.backward()
    b.backward()
    for name, g in grads(full).items():
        torch.testing.assert_close(grads(fused)[name], g, rtol=5e-2, atol=5e-3, msg=name)


@gpu
@pytest.mark.slow
def test_a_compiled_flex_fused_bf16_run_on_cuda_counts_what_the_cpu_run_counts(small_streams, tmp_path):
    cpu, _ = run_streams(small_streams, tmp_path, 'cpu')
    fast, _ = run_streams(small_streams, tmp_path, 'cuda', attn_implementation='flex_attention', fused_loss=True,
                          top={'compile_config': {}, 'device': 'gpu', 'precision': 'amp_bf16'})
    for name in cpu:
        for key in ('samples', 'tokens', 'loss_tokens', 'loss_targets'):
            assert fast[name][key] == cpu[name][key], (name, key)
        assert fast[name]['loss'] == pytest.approx(cpu[name]['loss'], rel=2e-2)


def test_the_train_metric_equals_composers_cross_entropy_on_the_logits_for_both_paths():
    """The train ``LanguageCrossEntropy`` comes from the loss's row sums; Composer's own metric on
    the full logits is the independent reference."""
    from composer.metrics.nlp import LanguageCrossEntropy

    batch = packed_batch()
    full, fused = pair(LLAMA, {'fused_loss': True}, fused=True)
    reference = LanguageCrossEntropy(ignore_index=-100)
    with torch.no_grad():
        logits = full(batch).logits
    reference.update(logits[:, :-1].contiguous(), batch['labels'][:, 1:].contiguous())
    for model in (full, fused):
        outputs = model(batch)
        model.loss(outputs, batch)
        metric = model.get_metrics(is_train=True)['LanguageCrossEntropy']
        metric.reset()
        model.update_metric(batch, outputs, metric)
        torch.testing.assert_close(metric.compute(), reference.compute(), rtol=1e-6, atol=1e-6)

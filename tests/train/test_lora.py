"""LoRA finetuning through peft (``model.peft_config`` as in LLM-Foundry).

The base is a tiny Llama saved with ``save_pretrained`` beside the bundled tokenizer; runs are
real Composer runs on the real small streams (CPU, fp32). What is checked against an
independent source: the base tensors after training against the base directory's safetensors
file, the optimizer's parameters against the LoRA layers peft's own class finds, a killed and
resumed run against a straight one (bitwise), the merged export's logits against the trained
peft model's, the adapter export loaded by peft's ``PeftModel.from_pretrained`` over the base.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib

import pytest
import torch
import yaml
from helpers import DEMO_TOKENIZER, ROOT, SMALL_SEQ, tiny_run_config

from foundrymix.cli import main as cli
from foundrymix.config import ConfigError
from foundrymix.train.config import TrainConfig

LLAMA = tiny_run_config({})['model']
LORA = {'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'r': 4, 'lora_alpha': 8, 'lora_dropout': 0.1,
        'target_modules': ['q_proj', 'v_proj']}
#: the layers of transformers' Llama that LoRA can adapt, in the model's order
LLAMA_LAYERS = 'embed_tokens, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head'
BATCH = 4
N_BATCHES = 12


def save_base(directory, seed: int) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from foundrymix.tokenizer import load_tokenizer

    torch.manual_seed(seed)
    kwargs = {k: v for k, v in LLAMA.items() if k != 'type'}
    AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=8192, use_cache=False, **kwargs)).save_pretrained(directory)
    load_tokenizer(DEMO_TOKENIZER).save_pretrained(directory)


@pytest.fixture(scope='module')
def base_dir(tmp_path_factory):
    """A tiny Llama (random weights, seed 0) saved as a model directory with the streams' tokenizer."""
    out = tmp_path_factory.mktemp('base') / 'tiny-llama'
    save_base(out, seed=0)
    return out


def loader_config(streams) -> dict:
    return {'streams': {n: {'local': str(p)} for n, p in streams.items()}, 'shuffle': True, 'shuffle_seed': 3,
            'num_workers': 0}


def lora_config(streams, base, peft=None, **top) -> dict:
    model = {'pretrained': str(base), 'peft_config': dict(LORA if peft is None else peft)}
    defaults = {'global_train_batch_size': BATCH, 'max_duration': f'{N_BATCHES}ba', 'run_name': 'lora'}
    return tiny_run_config(loader_config(streams), model=model, **{**defaults, **top})


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize('peft, message', [
    ({**LORA, 'lora_alhpa': 16},
     "model.peft_config.lora_alhpa: unknown key of peft's LoraConfig; did you mean 'lora_alpha'? its keys: "),
    ({**LORA, 'peft_type': 'IA3'}, "model.peft_config.peft_type: 'IA3': only LORA is supported (as in LLM-Foundry)"),
    ({**LORA, 'task_type': 'SEQ_CLS'}, "model.peft_config.task_type: 'SEQ_CLS': only CAUSAL_LM is supported"),
    ({**LORA, 'init_lora_weights': 'pissa'},
     "model.peft_config.init_lora_weights: 'pissa': not supported here (it changes the base weights or needs "
     "data before training); use true, false or gaussian"),
    ({**LORA, 'base_model_name_or_path': '/x'},
     'model.peft_config.base_model_name_or_path: not a setting here (the base is model.pretrained); delete it'),
])
def test_bad_peft_config_keys_are_refused_naming_the_key(peft, message):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict(tiny_run_config({'streams': {'a': {'local': '/x'}}},
                                              model={**LLAMA, 'peft_config': peft}, max_duration='1ba',
                                              global_train_batch_size=2))
    assert message in str(err.value)
    assert '\n' not in str(err.value)


def test_unknown_key_lists_every_key_of_peft_lora_config():
    import dataclasses

    from peft import LoraConfig
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict(tiny_run_config({'streams': {'a': {'local': '/x'}}},
                                              model={**LLAMA, 'peft_config': {'rank': 4}}, max_duration='1ba',
                                              global_train_batch_size=2))
    listed = str(err.value).split('its keys: ')[1].split(', ')
    own = {'task_type', 'peft_type', 'auto_mapping', 'peft_version', 'base_model_name_or_path', 'revision',
           'inference_mode'}
    assert set(listed) == {f.name for f in dataclasses.fields(LoraConfig) if f.init} - own
    assert {'r', 'lora_alpha', 'lora_dropout', 'target_modules', 'modules_to_save'} <= set(listed)


def test_without_peft_the_config_is_refused_with_the_install_line(small_streams, base_dir, tmp_path):
    """A real train.py process in which peft cannot be imported: one line, exit 2, the key and the
    install command -- and that command's extra exists."""
    cfg = tmp_path / 'lora.yaml'
    cfg.write_text(yaml.safe_dump(lora_config(small_streams, base_dir)), encoding='utf-8')
    code = ("import sys; sys.modules['peft'] = None; sys.argv = ['train.py', sys.argv[1]]; "
            "from foundrymix.train.cli import main; sys.exit(main())")
    proc = subprocess.run([sys.executable, '-c', code, str(cfg)], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300, env={**os.environ, 'PYTHONPATH': str(ROOT)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"foundrymix train: error: {cfg}: model.peft_config: LoRA needs the peft library, which is not installed: "
        f"pip install 'foundrymix[peft]'"]
    extras = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['optional-dependencies']
    assert any(r.startswith('peft') for r in extras['peft'])
    assert any('peft' in r for r in extras['test'])


def test_migrate_without_peft_carries_peft_config_and_asks_for_peft(tmp_path, capsys, monkeypatch):
    from helpers import FOUNDRY_DIR

    monkeypatch.setitem(sys.modules, 'peft', None)  # import peft fails, as where it is not installed
    out = tmp_path / 'new.yaml'
    assert cli(['migrate', str(FOUNDRY_DIR / 'dbrx-lora-ft.yaml'), '--out', str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if 'peft' in line.split(': LoRA through')[0] and 'wrote' not in line] == [
        "kept: model.peft_config (r: 64, peft_type: LORA, task_type: CAUSAL_LM, lora_alpha: 128, lora_dropout: 0.05, "
        "target_modules: ['Wqkv']): LoRA through the peft library, as in LLM-Foundry: the base weights are frozen, "
        "the adapter trains; target_modules are checked against the model's layers at start; export writes the "
        "merged model, or with --adapter the adapter alone",
        "to do: model.peft_config: LoRA needs the peft library, which is not installed: pip install "
        "'foundrymix[peft]' (the migrated YAML is refused so)"]
    assert 'to do: 5 line(s) above before it runs' in lines  # 4 with peft (test_migrate.py)
    assert yaml.safe_load(out.read_text())['model']['peft_config']['target_modules'] == ['Wqkv']


@pytest.mark.parametrize('targets, message', [
    (['q_proj', 'q_prj'], "model.peft_config.target_modules: 'q_prj' matches no layer of the llama model that LoRA "
                          f"can adapt; choose from its layers: {LLAMA_LAYERS}"),
    (['self_attn'], "model.peft_config.target_modules: 'self_attn' matches no layer of the llama model that LoRA "
                    f"can adapt; choose from its layers: {LLAMA_LAYERS}"),
    (r'.*\.attn\.q_proj', r"model.peft_config.target_modules: '.*\\.attn\\.q_proj' (a regex, matched against full "
                          f"module names) matches no layer of the llama model that LoRA can adapt; its layers: "
                          f"{LLAMA_LAYERS} (full names such as model.embed_tokens)"),
])
def test_target_modules_that_match_no_layer_are_refused_listing_the_layers(small_streams, base_dir, tmp_path,
                                                                          targets, message, capsys):
    """peft itself trains q_proj alone for ['q_proj', 'q_prj'] and says nothing. ``plan`` refuses
    as ``train`` does (the model built on the meta device)."""
    cfg = tmp_path / 'lora.yaml'
    cfg.write_text(yaml.safe_dump(lora_config(small_streams, base_dir, {**LORA, 'target_modules': targets},
                                              save_folder=str(tmp_path / 'ckpt'))), encoding='utf-8')
    proc = subprocess.run([sys.executable, str(ROOT / 'train.py'), str(cfg)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [f'foundrymix train: error: {message}']
    assert not (tmp_path / 'ckpt').exists()
    capsys.readouterr()
    assert cli(['plan', str(cfg)]) == 2
    assert capsys.readouterr().err.splitlines() == [f'foundrymix plan: error: {message}']


def test_modules_to_save_must_name_a_module(small_streams, base_dir, tmp_path):
    from foundrymix.train.builder import build_trainer

    cfg = TrainConfig.from_dict(lora_config(small_streams, base_dir, {**LORA, 'modules_to_save': ['lm_haed']}))
    with pytest.raises(ConfigError) as err:
        build_trainer(cfg)
    assert str(err.value).startswith("model.peft_config.modules_to_save: 'lm_haed' matches no module of the "
                                     "llama model; choose from: model, embed_tokens, layers, self_attn, q_proj, k_proj")


# ----------------------------------------------------------------------------- a run

def base_tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(directory / 'model.safetensors'))


@pytest.fixture(scope='module')
def trained(small_streams, base_dir, tmp_path_factory):
    """A LoRA run from the base: 12 batches, a checkpoint at the end, and its merged and adapter exports."""
    from foundrymix.loader.mixer import StreamMixer
    from foundrymix.train.builder import build_trainer

    root = tmp_path_factory.mktemp('lora-run')
    cfg = TrainConfig.from_dict(lora_config(
        small_streams, base_dir, save_folder=str(root / 'ckpt'), save_interval=f'{N_BATCHES}ba',
        callbacks={'stream_accounting': {'out_dir': str(root / 'report'), 'plot': False}}))
    run = build_trainer(cfg)
    run.trainer.fit()
    run.trainer.close()
    ckpt = root / 'ckpt' / 'latest-rank0.pt'
    assert cli(['export', str(ckpt), '--to-hf', str(root / 'merged')]) == 0
    assert cli(['export', str(ckpt), '--to-hf', str(root / 'adapter'), '--adapter']) == 0
    batch = next(iter(StreamMixer.from_dict(loader_config(small_streams)).build_dataloader(batch_size=8)))
    return {'root': root, 'ckpt': ckpt, 'trainer': run.trainer, 'model': run.trainer.state.model.eval(),
            'batch': batch}


def lora_layers(model) -> list[str]:
    from peft.tuners.lora import LoraLayer
    return [n for n, m in model.named_modules() if isinstance(m, LoraLayer)]


@pytest.mark.slow  # a whole training run
def test_only_the_adapter_trains_and_the_base_stays_bitwise(trained, base_dir):
    state = torch.load(trained['ckpt'], map_location='cpu', weights_only=False)['state']
    weights = state['model']
    assert state['timestamp']['Timestamp']['batch'] == N_BATCHES
    base = base_tensors(base_dir)
    frozen = {k: v for k, v in weights.items() if 'lora_' not in k}
    assert len(frozen) == len(base)
    for key, value in frozen.items():
        name = key.removeprefix('model.base_model.model.').replace('.base_layer.', '.')
        assert torch.equal(value, base[name]), f'{name} changed in training'
    adapter = {k: v for k, v in weights.items() if 'lora_' in k}
    assert sorted(adapter) == sorted(f'model.base_model.model.model.layers.0.self_attn.{p}.lora_{ab}.default.weight'
                                     for p in ('q_proj', 'v_proj') for ab in 'AB')
    for key, value in adapter.items():
        if 'lora_B' in key:  # peft starts B at zero: it moved
            assert value.abs().sum() > 0, key


@pytest.mark.slow  # a whole training run
def test_the_optimizer_holds_only_the_adapter(trained):
    model = trained['model']
    layers = lora_layers(model)
    assert [n.rsplit('.', 1)[-1] for n in layers] == ['q_proj', 'v_proj']
    adapter = [p for n in layers for p in (model.get_submodule(n).lora_A['default'].weight,
                                           model.get_submodule(n).lora_B['default'].weight)]
    opt = trained['trainer'].state.optimizers[0]
    held = [p for g in opt.param_groups for p in g['params']]
    assert {id(p) for p in held} == {id(p) for p in adapter} and len(held) == 4
    saved = torch.load(trained['ckpt'], map_location='cpu', weights_only=False)['state']['optimizers']
    (opt_state,) = saved.values()
    assert len(opt_state['state']) == 4  # Adam moments for the 4 adapter tensors only


@pytest.mark.slow  # a whole training run
def test_merged_export_loads_in_transformers_with_the_peft_models_logits(trained, base_dir):
    from transformers import AutoModelForCausalLM

    merged_dir = trained['root'] / 'merged'
    assert {p.name for p in merged_dir.iterdir()} >= {'config.json', 'model.safetensors', 'tokenizer.json'}
    assert not (merged_dir / 'adapter_config.json').exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, local_files_only=True).eval()
    assert type(merged).__name__ == 'LlamaForCausalLM'
    assert set(base_tensors(merged_dir)) == set(base_tensors(base_dir))  # plain Llama tensors, no lora_
    base = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True).eval()
    b = trained['batch']
    with torch.no_grad():
        expected = trained['model'](b).logits
        got = merged(input_ids=b['input_ids'], position_ids=b['position_ids'], use_cache=False).logits
        before = base(input_ids=b['input_ids'], position_ids=b['position_ids'], use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, expected, atol=1e-4)  # the adapter changed the model


@pytest.mark.slow  # a whole training run
def test_adapter_export_loads_over_the_base_with_peft(trained, base_dir):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    adapter_dir = trained['root'] / 'adapter'
    assert not (adapter_dir / 'model.safetensors').exists()
    config = json.loads((adapter_dir / 'adapter_config.json').read_text())
    assert config['base_model_name_or_path'] == str(base_dir)
    assert config['r'] == 4 and config['lora_alpha'] == 8 and sorted(config['target_modules']) == ['q_proj', 'v_proj']
    assert len(load_file(str(adapter_dir / 'adapter_model.safetensors'))) == 4
    base = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    b = trained['batch']
    with torch.no_grad():
        expected = trained['model'](b).logits
        got = model(input_ids=b['input_ids'], position_ids=b['position_ids'], use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # a whole training run
def test_adapter_export_refuses_a_base_directory_that_changed(trained, tmp_path, capsys):
    other = tmp_path / 'other-llama'
    save_base(other, seed=1)
    ckpt = torch.load(trained['ckpt'], map_location='cpu', weights_only=False)
    ckpt['state']['callbacks']['ModelInfo']['pretrained'] = str(other)
    torch.save(ckpt, tmp_path / 'moved.pt')
    capsys.readouterr()
    assert cli(['export', str(tmp_path / 'moved.pt'), '--to-hf', str(tmp_path / 'out'), '--adapter']) == 2
    err = capsys.readouterr().err
    assert err == (f'foundrymix export: error: --adapter: {other / "model.safetensors"}: lm_head.weight differs '
                   f'from the base weights the adapter was trained on (the directory changed since, or the run '
                   f'took only its config): export without --adapter (the merged model)\n')
    assert not (tmp_path / 'out').exists()


# ----------------------------------------------------------------------------- resume

def write_run(path, streams, base, **top):
    cfg = lora_config(streams, base, save_folder=str(path.parent / 'ckpt'), save_interval='3ba',
                      callbacks={'sample_log': {'path': str(path.parent / 'samples.jsonl')}}, **top)
    path.write_text(yaml.safe_dump(cfg), encoding='utf-8')
    return path


def run_train(config) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / 'train.py'), str(config)], capture_output=True, text=True,
                          cwd=config.parent, timeout=300)
    assert proc.returncode == 0, f'{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}'


def final_weights(folder) -> dict[str, torch.Tensor]:
    return torch.load(folder / 'latest-rank0.pt', map_location='cpu', weights_only=False)['state']['model']


@pytest.mark.slow  # whole train.py runs, one killed
def test_sigkill_then_autoresume_gives_the_straight_runs_adapter_bitwise(small_streams, base_dir, tmp_path):
    """lora_dropout 0.1: the resumed run must also continue the dropout masks' random stream."""
    straight = tmp_path / 'straight'
    straight.mkdir()
    run_train(write_run(straight / 'c.yaml', small_streams, base_dir))

    killed = tmp_path / 'killed'
    killed.mkdir()
    cfg = write_run(killed / 'c.yaml', small_streams, base_dir, autoresume=True)
    proc = subprocess.Popen([sys.executable, str(ROOT / 'train.py'), str(cfg)], cwd=killed,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = killed / 'ckpt' / 'latest-rank0.pt'

    def saved_ba6() -> bool:
        return latest.is_symlink() and os.readlink(latest).endswith('ep0-ba6-rank0.pt')
    deadline = time.time() + 240
    while not saved_ba6() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert saved_ba6(), 'no checkpoint at batch 6 before the deadline'
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    at = torch.load(latest, map_location='cpu', weights_only=False)['state']['timestamp']['Timestamp']
    assert at['batch'] == 6 and at['batch_in_epoch'] > 0  # mid-epoch: Composer alone would not restore the RNG
    logged = [json.loads(line) for line in (killed / 'samples.jsonl').read_text().splitlines() if line.strip()]
    assert len(logged) < N_BATCHES, 'the run finished before it was killed'
    run_train(cfg)

    want, got = final_weights(straight / 'ckpt'), final_weights(killed / 'ckpt')
    assert got.keys() == want.keys() and sum('lora_' in k for k in got) == 4
    for key in want:
        assert torch.equal(got[key], want[key]), f'{key} differs from the straight run'
    samples = [json.loads(line) for line in (killed / 'samples.jsonl').read_text().splitlines() if line.strip()]
    assert samples == [json.loads(line) for line in (straight / 'samples.jsonl').read_text().splitlines()
                       if line.strip()]
    assert not torch.equal(want['model.base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight'],
                           torch.zeros_like(want['model.base_model.model.model.layers.0.self_attn.q_proj.lora_B'
                                                     '.default.weight']))


# ----------------------------------------------------------------------------- from LLM-Foundry

@pytest.mark.slow  # a whole training run
def test_foundrys_lora_yaml_migrated_trains_its_adapter(small_streams, tmp_path, capsys):
    """LLM-Foundry's finetune/dbrx-lora-ft.yaml, migrated: peft_config is carried, and with its to-do
    lines done (data, a local DBRX -- a tiny one here) and the CPU overrides it trains LoRA on Wqkv."""
    from helpers import FOUNDRY_DIR, tiny_dbrx

    out = tmp_path / 'new.yaml'
    assert cli(['migrate', str(FOUNDRY_DIR / 'dbrx-lora-ft.yaml'), '--out', str(out)]) == 0
    report = capsys.readouterr().out.splitlines()
    assert [line.split(': LoRA')[0] for line in report if 'peft_config' in line] == [
        "kept: model.peft_config (r: 64, peft_type: LORA, task_type: CAUSAL_LM, lora_alpha: 128, lora_dropout: 0.05, "
        "target_modules: ['Wqkv'])"]
    assert yaml.safe_load(out.read_text())['model']['peft_config'] == {
        'r': 64, 'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'lora_alpha': 128, 'lora_dropout': 0.05,
        'target_modules': ['Wqkv']}
    cpu = next(line for line in report if line.startswith('for a CPU trial add: ')).split(': ', 1)[1].split()
    dbrx = tiny_dbrx(tmp_path / 'dbrx')
    todo = [f'train_loader.streams.train.local={small_streams["dolly"]}',
            f'eval_loader.streams.eval.local={small_streams["dolly"]}', f'model.pretrained_model_name_or_path={dbrx}',
            'model.attention=causal']  # train's own refusal for DBRX, once the model is a local directory
    scale = [f'tokenizer={DEMO_TOKENIZER}', f'max_seq_len={SMALL_SEQ}', 'global_train_batch_size=4',
             'device_train_microbatch_size=2', 'device_eval_batch_size=2', 'max_duration=2ba',
             'eval_subset_num_batches=1', 'train_loader.num_workers=0', 'eval_loader.num_workers=0',
             f'save_folder={tmp_path / "ckpt"}']
    assert cli(['train', str(out), *cpu, *todo, *scale]) == 0
    from safetensors.torch import load_file
    saved = load_file(str(dbrx / 'model.safetensors'))
    out_features, in_features = saved['transformer.blocks.0.norm_attn_norm.attn.Wqkv.weight'].shape
    lora = 64 * (in_features + out_features)
    printed = capsys.readouterr().out.splitlines()
    assert f'model: loaded {len(saved)} tensors from {dbrx} (none left at init)' in printed
    total = sum(t.numel() for t in saved.values()) + lora
    assert (f'model: LoRA r=64 on Wqkv (1 layers): {lora:,} of {total:,} parameters train '
            f'({100 * lora / total:.2f} %); the others are frozen') in printed
    ckpt = tmp_path / 'ckpt' / 'latest-rank0.pt'
    weights = torch.load(ckpt, map_location='cpu', weights_only=False)['state']['model']
    adapter = {k: tuple(v.shape) for k, v in weights.items() if 'lora_' in k}
    prefix = 'model.base_model.model.transformer.blocks.0.norm_attn_norm.attn.Wqkv'
    assert adapter == {f'{prefix}.lora_A.default.weight': (64, in_features),
                       f'{prefix}.lora_B.default.weight': (out_features, 64)}


def test_load_weights_only_is_refused_with_the_way_to_start_from_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict(tiny_run_config({'streams': {'a': {'local': '/x'}}},
                                              model={**LLAMA, 'peft_config': LORA}, max_duration='1ba',
                                              global_train_batch_size=2, load_path=str(tmp_path / 'c.pt'),
                                              load_weights_only=True))
    assert str(err.value) == (
        'load_weights_only: a LoRA run (model.peft_config) takes its base from model.pretrained: export the '
        'checkpoint (foundrymix export CHECKPOINT --to-hf DIR) and set model.pretrained: DIR; to go on with a LoRA '
        'run, resume it (load_path without load_weights_only)')


def test_without_target_modules_peft_defaults_or_the_refusal_lists_the_layers():
    """peft knows Llama's default (q_proj, v_proj); for DBRX it has none: one line with its layers."""
    from transformers import DbrxConfig, DbrxForCausalLM, LlamaConfig, LlamaForCausalLM

    from foundrymix.train.lora import wrap
    kwargs = {k: v for k, v in LLAMA.items() if k != 'type'}
    llama = wrap(LlamaForCausalLM(LlamaConfig(vocab_size=64, **kwargs)), {'r': 4, 'task_type': 'CAUSAL_LM'})
    assert [n.rsplit('.', 1)[-1] for n in lora_layers(llama)] == ['q_proj', 'v_proj']
    dbrx = DbrxForCausalLM(DbrxConfig(d_model=16, n_heads=2, n_layers=1, vocab_size=64,
                                      attn_config={'kv_n_heads': 2, 'rope_theta': 1e4},  # 5.x: no default
                                      ffn_config={'ffn_hidden_size': 32, 'moe_num_experts': 2, 'moe_top_k': 1}))
    with pytest.raises(ConfigError) as err:
        wrap(dbrx, {'r': 4, 'task_type': 'CAUSAL_LM'})
    assert str(err.value) == ('model.peft_config.target_modules: missing, and peft has no default for a dbrx model: '
                              'give the layers to adapt, from: wte, Wqkv, out_proj, layer, lm_head')

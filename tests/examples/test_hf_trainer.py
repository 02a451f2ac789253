"""examples/hf_trainer.py: the Hugging Face Trainer (its defaults) on a staged foundrymix mix; a run
SIGKILLed mid-way and resumed with ``resume_from_checkpoint`` trains the straight run's rows in every
step and ends with bitwise-equal weights; on 2 processes (torchrun, gloo) each rank trains its slice."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from example_runs import assert_same_weights, command, run, run_until_killed
from helpers import free_port

pytest.importorskip('accelerate')


def steps(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.slow
def test_killed_and_resumed_equals_the_straight_run(tmp_path):
    data, straight, killed = tmp_path / 'data', tmp_path / 'straight', tmp_path / 'killed'
    assert 'done: 30 steps' in run(command('hf_trainer.py', straight, data))
    want = steps(straight / 'samples.jsonl')
    assert [s['step'] for s in want] == list(range(1, 31))
    # stage 'text' (12 batches) is arXiv only, then the mix stage brings Dolly in
    assert all(set(s['stream']) == {0} for s in want[:12])
    assert {1} <= set(sum((s['stream'] for s in want[12:]), []))
    # every global batch holds 8 distinct rows, and no row repeats within the run's one pass of arXiv
    assert all(len(set(s['sample'])) == 8 for s in want)

    # killed at step 15, 5 steps past the checkpoint of step 10
    run_until_killed(command('hf_trainer.py', killed, data, '--hold-at', '15'), killed / 'samples.jsonl', 15)
    assert steps(killed / 'samples.jsonl') == want[:15]
    assert torch.load(killed / 'checkpoint-10' / 'foundrymix_loader.pt', weights_only=True)['batch'] == 10
    assert 'resumed at step 10 (global batch 10)' in run(command('hf_trainer.py', killed, data))
    assert steps(killed / 'samples.jsonl') == want
    assert_same_weights(load_file(straight / 'final' / 'model.safetensors'),
                        load_file(killed / 'final' / 'model.safetensors'))


@pytest.mark.slow
def test_two_processes_train_the_straight_rows_each_its_slice(tmp_path):
    data, straight, two = tmp_path / 'data', tmp_path / 'straight', tmp_path / 'two'
    run(command('hf_trainer.py', straight, data))
    torchrun = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2',
                '--master_port', str(free_port())]
    cmd = command('hf_trainer.py', two, data)
    run([*torchrun, *cmd[1:]])
    # the log joins both ranks' rows of each step in rank order: the straight run's global batches
    assert steps(two / 'samples.jsonl') == steps(straight / 'samples.jsonl')


def test_a_checkpoint_without_the_loader_state_is_refused(tmp_path):
    from foundrymix.config import ConfigError
    from foundrymix.integrations.hf_trainer import read_loader_state
    (tmp_path / 'checkpoint-10').mkdir()
    (tmp_path / 'checkpoint-10' / 'trainer_state.json').write_text('{"global_step": 10}')
    with pytest.raises(ConfigError, match='no foundrymix_loader.pt there'):
        read_loader_state(str(tmp_path / 'checkpoint-10'), 1)


@pytest.fixture(scope='module')
def loader(small_streams):
    import foundrymix
    config = {'global_train_batch_size': 4, 'max_duration': '10ba',
              'train_loader': {'streams': {'arxiv': {'local': str(small_streams['arxiv'])},
                                           'dolly': {'local': str(small_streams['dolly'])}}}}
    return foundrymix.build_loader(config, rank=0, world_size=1)


def test_the_trainer_defaults_become_the_loaders_run(loader, tmp_path):
    from transformers import TrainingArguments
    from foundrymix.integrations.hf_trainer import fit_arguments
    mine = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    fitted = fit_arguments(mine, loader)
    # 10 batches of 4 rows on one rank: 10 optimizer steps, the per-rank batch 4, no data skip
    assert (fitted.max_steps, fitted.per_device_train_batch_size, fitted.num_train_epochs) == (10, 4, 1)
    assert fitted.ignore_data_skip is True and mine.max_steps == -1  # the user's arguments unchanged
    mine = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], gradient_accumulation_steps=2,
                             max_steps=3, num_train_epochs=1, per_device_train_batch_size=4)
    assert fit_arguments(mine, loader).max_steps == 3  # honoured: the first 3 steps of the run


@pytest.mark.parametrize('setting, said', [
    ({'num_train_epochs': 2}, 'num_train_epochs=2: the loader is the whole run'),
    ({'per_device_train_batch_size': 2}, 'per_device_train_batch_size=2: the loader gives each rank 4 rows'),
    ({'dataloader_num_workers': 2}, 'set train_loader.num_workers in the YAML'),
    ({'data_seed': 5}, 'set train_loader.shuffle_seed in the YAML'),
    ({'max_steps': 11}, 'max_steps=11: the loader has 10 batches, 10 optimizer steps'),
])
def test_an_argument_the_loader_decides_is_refused_naming_the_yaml_key(loader, tmp_path, setting, said):
    from transformers import TrainingArguments
    from foundrymix.config import ConfigError
    from foundrymix.integrations.hf_trainer import fit_arguments
    with pytest.raises(ConfigError, match=said.replace('.', r'\.')):
        fit_arguments(TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **setting), loader)


def test_the_model_gets_only_the_keys_its_forward_takes(loader):
    from transformers import LlamaConfig, LlamaForCausalLM
    from foundrymix.integrations.hf_trainer import _model_keys
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    assert _model_keys(model, 'document') == {'input_ids', 'labels', 'position_ids'}
    assert _model_keys(model, 'causal') == {'input_ids', 'labels', 'attention_mask'}
    batch = next(iter(loader))
    assert {'sample_id', 'stream_id', 'sequence_id'} <= set(batch)  # what the filter keeps from the model


def test_packed_documents_attend_only_inside_themselves(loader, tmp_path):
    """What the Trainer gives the model of a packed row: the second document's logits equal the
    document's alone (a cache, Llama's default, would make transformers ignore position_ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
    from foundrymix.integrations.hf_trainer import FoundrymixTrainer
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    trainer = FoundrymixTrainer(model=model, loader=loader,
                                args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]))
    a, b = torch.tensor([[11, 12, 13, 14]]), torch.tensor([[21, 22, 23, 24]])
    packed = {'input_ids': torch.cat([a, b], 1), 'position_ids': torch.tensor([[0, 1, 2, 3] * 2]),
              'attention_mask': torch.ones(1, 8, dtype=torch.long), 'sample_id': torch.tensor([0])}
    with torch.no_grad():
        got = model(**trainer.model_inputs(packed)).logits[:, 4:]
        alone = model(input_ids=b, use_cache=False).logits
    assert torch.allclose(got, alone, atol=1e-5)
    assert set(trainer.model_inputs(packed)) == {'input_ids', 'position_ids', 'use_cache'}

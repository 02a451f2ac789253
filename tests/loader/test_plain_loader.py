"""The loader ``foundrymix.build_loader`` returns is a plain stateful iterable that other trainers
take unchanged: ``accelerate``'s ``prepare``, the Hugging Face ``Trainer`` (whose
``get_train_dataloader`` returns ``accelerator.prepare(loader)``) and Lightning Fabric's
``save``/``load`` train the rows a plain loop trains, batch for batch, and resume from its
``state_dict`` exactly where they stopped.

The reference is a real run's sample log: the sample ids a plain loop trained over the whole
run (two stages over the bundled sample streams, the switch inside the first steps). A tiny
Llama from a config trains on CPU in every path; nothing is downloaded.
"""

from __future__ import annotations

import io

import pytest
import torch

import foundrymix
from helpers import staged as config

STEPS = 7  # past the stage switch at batch 5


def tiny_llama(loader):
    from transformers import LlamaConfig, LlamaForCausalLM
    vocab = loader.plan.stages[0].infos[0].manifest.tokenizer.vocab_size
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=loader.plan.max_seq_len))


def loss_of(model, batch):
    return model(input_ids=batch['input_ids'], labels=batch['labels'],
                 attention_mask=batch['attention_mask']).loss


def through_checkpoint(state: dict) -> dict:
    """Through a real checkpoint file's bytes, loaded as torch loads by default (weights_only)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def ids(batches) -> list[list[int]]:
    return [b['sample_id'].tolist() for b in batches]


@pytest.fixture(scope='module')
def straight(small_streams) -> list[list[int]]:
    """A plain loop: it trains the first STEPS batches, then reads the run to its end."""
    loader = foundrymix.build_loader(config(small_streams), rank=0, world_size=1)
    model = tiny_llama(loader)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    log = []
    for step, batch in enumerate(loader, start=1):
        log.append(batch['sample_id'].tolist())
        if step <= STEPS:
            optimizer.zero_grad()
            loss_of(model, batch).backward()
            optimizer.step()
    assert len(log) == len(loader) == 14
    assert len({i for b in log for i in b}) > 4  # (a shuffled mix, not one batch repeated)
    return log


def test_it_is_no_torch_dataloader(small_streams):
    """What accelerate and Lightning rebuild from its ``dataset`` is a torch DataLoader."""
    loader = foundrymix.build_loader(config(small_streams), rank=0, world_size=1)
    assert not isinstance(loader, torch.utils.data.DataLoader)
    assert not hasattr(loader, 'dataset') and not hasattr(loader, 'stop_together')
    assert loader.stream_names == ['arxiv', 'dolly'] and [s.name for s in loader.plan.stages] == ['text', 'mix']


def test_accelerate_prepare_trains_the_same_rows_and_resumes(small_streams, straight):
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(foundrymix.build_loader(config(small_streams), rank=0, world_size=1))
    model = tiny_llama(loader)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen = []
    for batch in loader:
        seen.append(batch['sample_id'].tolist())
        optimizer.zero_grad()
        accelerator.backward(loss_of(model, batch))
        optimizer.step()
        if len(seen) == STEPS:
            break
    assert seen == straight[:STEPS]
    state = through_checkpoint(loader.state_dict())
    resumed = accelerator.prepare(foundrymix.build_loader(config(small_streams), rank=0, world_size=1))
    resumed.load_state_dict(state)
    assert ids(resumed) == straight[STEPS:]


def test_the_hf_trainer_trains_the_same_rows_and_resumes(small_streams, straight, tmp_path):
    from transformers import Trainer, TrainingArguments

    class LoaderTrainer(Trainer):
        """The Trainer's own path: ``get_train_dataloader`` returns ``accelerator.prepare`` of it."""

        def __init__(self, loader, **kwargs) -> None:
            super().__init__(**kwargs)
            self.loader, self.seen = loader, []

        def get_train_dataloader(self):
            return self.accelerator.prepare(self.loader)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.seen.append(inputs['sample_id'].tolist())
            out = model(input_ids=inputs['input_ids'], labels=inputs['labels'],
                        attention_mask=inputs['attention_mask'])
            return (out.loss, out) if return_outputs else out.loss

    loader = foundrymix.build_loader(config(small_streams), rank=0, world_size=1)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, use_cpu=True, report_to=[],
                             save_strategy='no', logging_strategy='no', disable_tqdm=True,
                             learning_rate=0.1)
    trainer = LoaderTrainer(loader, model=tiny_llama(loader), args=args)
    trainer.train()
    assert trainer.seen == straight[:STEPS]
    state = through_checkpoint(loader.state_dict())
    assert state['batch'] == STEPS  # it read no batch it did not train
    resumed = foundrymix.build_loader(config(small_streams), rank=0, world_size=1)
    resumed.load_state_dict(state)
    assert ids(resumed) == straight[STEPS:]


def test_fabric_saves_and_loads_it_with_the_model(small_streams, straight, tmp_path):
    """Fabric's ``setup_dataloaders`` takes torch DataLoaders only; the loader, already this
    rank's, is used as it is and checkpointed by ``fabric.save``/``fabric.load``."""
    from lightning_fabric import Fabric
    fabric = Fabric(accelerator='cpu', devices=1)
    loader = foundrymix.build_loader(config(small_streams), rank=fabric.global_rank,
                                     world_size=fabric.world_size)
    model = fabric.setup(tiny_llama(loader))
    seen = []
    for batch in loader:
        seen.append(batch['sample_id'].tolist())
        if len(seen) == 3:
            break
    fabric.save(tmp_path / 'ckpt', {'loader': loader, 'model': model})
    resumed = foundrymix.build_loader(config(small_streams), rank=0, world_size=1)
    fabric.load(tmp_path / 'ckpt', {'loader': resumed, 'model': model})
    assert seen + ids(resumed) == straight

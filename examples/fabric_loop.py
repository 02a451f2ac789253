"""Lightning Fabric on a foundrymix loader: a Hugging Face Llama trains on a mix and resumes exactly.

Fabric checkpoints every object with ``state_dict()`` / ``load_state_dict()``, so the loader
goes into ``fabric.save`` / ``fabric.load`` next to the model and the optimizer, and a
resumed run trains exactly the rows the straight run trains. The loader is built for
Fabric's rank and world size and handed to the loop as it is (not through
``fabric.setup_dataloaders``: each rank's rows of every global batch are already fixed).

    pip install lightning-fabric
    python examples/fabric_loop.py --out out/fabric_loop      # runs, or resumes a killed run

On CPU it takes seconds (the first run also converts the samples into ``--data``). Every
step appends the stream and sample ids of its rows to ``<out>/samples.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
from lightning_fabric import Fabric
from transformers import LlamaConfig, LlamaForCausalLM

import foundrymix

ROOT = Path(__file__).resolve().parent.parent


def data_config(data: Path) -> dict:
    """The data part of a training YAML, as a dict: 3 parts arXiv to 1 part Dolly, 40 batches."""
    return {
        'global_train_batch_size': 8,
        'max_duration': '40ba',
        'train_loader': {
            'streams': {'arxiv': {'local': str(data / 'arxiv'), 'proportion': 0.75},
                        'dolly': {'local': str(data / 'dolly'), 'proportion': 0.25}},
            'shuffle_seed': 5,
        },
    }


def convert_samples(data: Path, max_seq_len: int = 128) -> None:
    """The bundled samples as foundrymix streams (once; the bundled tokenizer, offline)."""
    from foundrymix.convert.finetune import FinetuneOptions, convert_finetune
    from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain
    samples = ROOT / 'data' / 'samples'
    if not (data / 'arxiv' / 'foundrymix.json').exists():
        convert_pretrain([str(samples / 'arxiv_sample.jsonl')], str(data / 'arxiv'),
                         PretrainOptions(max_seq_len=max_seq_len, size_limit='256kb'))
    if not (data / 'dolly' / 'foundrymix.json').exists():
        convert_finetune([str(samples / 'dolly_hhrlhf_sample.jsonl')], str(data / 'dolly'),
                         FinetuneOptions(max_seq_len=max_seq_len, size_limit='256kb'))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--out', type=Path, default=ROOT / 'out' / 'fabric_loop')
    p.add_argument('--data', type=Path, default=None, help='the converted samples (default: OUT/data)')
    p.add_argument('--save-every', type=int, default=10)
    p.add_argument('--hold-at', type=int, default=None,
                   help='after this step, wait to be killed (how the test kills a run mid-way)')
    args = p.parse_args()
    torch.set_num_threads(1)  # one thread: the same float sums in every run
    fabric = Fabric(accelerator='cpu', devices=1, precision='32-true')
    fabric.seed_everything(0)
    data = args.data or args.out / 'data'
    if fabric.is_global_zero:
        convert_samples(data)
    fabric.barrier()
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt, log_path = args.out / 'checkpoint.ckpt', args.out / 'samples.jsonl'

    loader = foundrymix.build_loader(data_config(data), rank=fabric.global_rank, world_size=fabric.world_size)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=8192, hidden_size=64, intermediate_size=172, num_hidden_layers=2,  # the bundled tokenizer's
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=loader.plan.max_seq_len,
        tie_word_embeddings=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    state = {'model': model, 'optimizer': optimizer, 'loader': loader, 'step': 0}
    if ckpt.exists():  # Fabric calls load_state_dict on the model, the optimizer and the loader
        fabric.load(ckpt, state)
        print(f'resumed at step {state["step"]} (global batch {loader.position.batch})')
    step = state['step']
    lines = log_path.read_text().splitlines()[:step] if log_path.exists() else []
    log_path.write_text(''.join(line + '\n' for line in lines))  # a killed run's later steps go

    with open(log_path, 'a') as log:
        for batch in loader:
            batch = fabric.to_device(batch)
            loss = model(input_ids=batch['input_ids'], labels=batch['labels'],
                         attention_mask=batch['attention_mask']).loss
            optimizer.zero_grad(set_to_none=True)
            fabric.backward(loss)
            optimizer.step()
            step += 1
            log.write(json.dumps({'step': step, 'loss': loss.item(), 'stream': batch['stream_id'].tolist(),
                                  'sample': batch['sample_id'].tolist()}) + '\n')
            log.flush()
            if step % args.save_every == 0:  # written beside, then renamed over: atomic
                state['step'] = step
                fabric.save(ckpt.with_suffix('.tmp'), state)
                if fabric.is_global_zero:
                    os.replace(ckpt.with_suffix('.tmp'), ckpt)
            if step % 10 == 0:
                print(f'step {step}: loss {loss.item():.4f}; rows so far {loader.samples_per_stream()}')
            if step == args.hold_at:
                signal.pause()
    fabric.save(args.out / 'final.ckpt', {'model': model})
    print(f'done: {step} steps; rows per stream {loader.samples_per_stream()}')


if __name__ == '__main__':
    main()

"""The Hugging Face Trainer on a foundrymix mix: a Llama trains on a two-stage curriculum and resumes exactly.

``FoundrymixTrainer`` is ``transformers.Trainer`` given the loader: the loader's state goes into
every HF checkpoint, and ``trainer.train(resume_from_checkpoint=True)`` resumes the data where
the checkpoint's batches ended. The Trainer's defaults are kept; the loader decides the batch,
the order and the length of the run (the YAML's stages).

    pip install 'foundrymix[hf]'
    python examples/hf_trainer.py --out out/hf_trainer        # runs, or resumes a killed run
    torchrun --nproc_per_node 2 examples/hf_trainer.py --out out/hf_trainer_2   # 2 processes (CPU: gloo)

On CPU it takes seconds (the first run also converts the samples into ``--data``). Every
step appends the stream and sample ids of its rows to ``<out>/samples.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path

from typing import Optional

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

import foundrymix
from foundrymix.integrations.hf_trainer import FoundrymixTrainer

ROOT = Path(__file__).resolve().parent.parent


def data_config(data: Path) -> dict:
    """The data part of a training YAML, as a dict (a YAML path works the same)."""
    return {
        'global_train_batch_size': 8,
        'train_loader': {
            'streams': {'arxiv': {'local': str(data / 'arxiv')}, 'dolly': {'local': str(data / 'dolly')}},
            'shuffle_seed': 3,
            'stages': [
                {'name': 'text', 'duration': '12ba', 'streams': {'arxiv': {'repeat': 1}}},
                {'name': 'mix', 'duration': '18ba',
                 'streams': {'arxiv': {'proportion': 0.5}, 'dolly': {'proportion': 0.5}}},
            ],
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


class SampleLog(TrainerCallback):
    """Appends each optimizer step's global batch (stream and sample ids of every rank's rows)
    to ``samples.jsonl``, and after step ``hold_at`` waits to be killed (how the test kills a run
    mid-way). The example's record: a real script needs nothing of this."""

    def __init__(self, path: Path, hold_at: Optional[int]) -> None:
        self.path, self.hold_at, self.rows = path, hold_at, []

    def record(self, batch: dict) -> None:
        self.rows.append((batch['stream_id'].tolist(), batch['sample_id'].tolist()))

    def on_step_end(self, args, state, control, **kwargs):
        streams, samples = sum((r[0] for r in self.rows), []), sum((r[1] for r in self.rows), [])
        self.rows = []
        if dist.is_initialized():  # every rank's rows, in rank order
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, (streams, samples))
            streams, samples = sum((e[0] for e in every), []), sum((e[1] for e in every), [])
        if state.is_world_process_zero:
            with open(self.path, 'a') as log:
                log.write(json.dumps({'step': state.global_step, 'stream': streams, 'sample': samples}) + '\n')
        if state.global_step == self.hold_at:
            signal.pause()


class LoggedTrainer(FoundrymixTrainer):
    """Hands each batch to the sample log before training on it."""

    sample_log: SampleLog

    def training_step(self, model, inputs, *args, **kwargs):
        self.sample_log.record(inputs)
        return super().training_step(model, inputs, *args, **kwargs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--out', type=Path, default=ROOT / 'out' / 'hf_trainer')
    p.add_argument('--data', type=Path, default=None, help='the converted samples (default: OUT/data)')
    p.add_argument('--save-every', type=int, default=10)
    p.add_argument('--hold-at', type=int, default=None,
                   help='after this step, wait to be killed (how the test kills a run mid-way)')
    args = p.parse_args()
    torch.set_num_threads(1)  # one thread: the same float sums in every run
    data = args.data or args.out / 'data'
    training = TrainingArguments(output_dir=str(args.out), save_steps=args.save_every, logging_steps=10,
                                 learning_rate=3e-3, report_to=[], use_cpu=True, seed=0)
    with training.main_process_first(desc='converting the samples'):
        convert_samples(data)

    loader = foundrymix.build_loader(data_config(data))  # this process's RANK of WORLD_SIZE
    set_seed(training.seed)  # the same initial weights in every run
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=8192, hidden_size=64, intermediate_size=172, num_hidden_layers=2,  # the bundled tokenizer's
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=loader.plan.max_seq_len,
        tie_word_embeddings=True))
    log = SampleLog(args.out / 'samples.jsonl', args.hold_at)
    trainer = LoggedTrainer(model=model, args=training, loader=loader, callbacks=[log])
    trainer.sample_log = log

    last = get_last_checkpoint(str(args.out)) if args.out.is_dir() else None
    step = int(last.rsplit('-', 1)[1]) if last else 0
    if training.process_index == 0:  # a killed run's steps after its checkpoint go from the log
        lines = log.path.read_text().splitlines()[:step] if log.path.exists() else []
        log.path.write_text(''.join(line + '\n' for line in lines))
    if last:
        print(f'resuming at step {step} from {last}')
    trainer.train(resume_from_checkpoint=last)
    if last:
        print(f'resumed at step {step} (global batch {step})')
    trainer.save_model(str(args.out / 'final'))
    print(f'done: {trainer.state.global_step} steps; rows per stream {loader.samples_per_stream()}')


if __name__ == '__main__':
    main()

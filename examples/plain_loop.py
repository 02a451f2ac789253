"""A plain PyTorch training loop on a foundrymix loader: no Composer, no trainer library.

A tiny GPT trains on a two-stage curriculum over the bundled samples (arXiv text, then a mix
of arXiv and Dolly instructions), checkpoints model + optimizer + loader position every
``--save-every`` steps (atomically: a kill never leaves a half-written checkpoint), and
resumes from the checkpoint when started again. A resumed run trains exactly what the
straight run trains: the loader's position is one global batch index.

    python examples/plain_loop.py --out out/plain_loop        # runs, or resumes a killed run
    python examples/plain_loop.py --out out/plain_loop --world-size 2   # 2 ranks (DDP, gloo)

A run may resume on another number of ranks: each rank reads its slice of the same global
batches (the weights then differ in the last bits: the ranks' gradients are summed in
another order).

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
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import foundrymix

ROOT = Path(__file__).resolve().parent.parent


def data_config(data: Path) -> dict:
    """The data part of a training YAML, as a dict (a YAML path works the same)."""
    return {
        'global_train_batch_size': 8,
        'train_loader': {
            'streams': {'arxiv': {'local': str(data / 'arxiv')}, 'dolly': {'local': str(data / 'dolly')}},
            'shuffle_seed': 17,
            'stages': [
                {'name': 'text', 'duration': '24ba', 'streams': {'arxiv': {'repeat': 1}}},
                {'name': 'mix', 'duration': '24ba',
                 'streams': {'arxiv': {'repeat': 0.05}, 'dolly': {'repeat': 1}}},
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


# -- the model: a tiny GPT whose attention stays inside each packed document
class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.ln2, self.mlp = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, max_seq_len: int, d: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        for emb in (self.wte, self.wpe):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, batch: dict) -> torch.Tensor:
        """The mean cross-entropy of next-token prediction on the batch's ``labels``."""
        seq, T = batch['sequence_id'], batch['input_ids'].shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        mask = (causal & (seq[:, :, None] == seq[:, None, :]))[:, None]  # same document, earlier
        x = self.wte(batch['input_ids']) + self.wpe(batch['position_ids'])
        for block in self.blocks:
            x = block(x, mask)
        logits = self.ln_f(x) @ self.wte.weight.T
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch['labels'][:, 1:].flatten())


def save(path: Path, state: dict) -> None:
    """Write the checkpoint next to ``path``, then rename it over ``path``: atomic."""
    tmp = path.with_suffix('.tmp')
    with open(tmp, 'wb') as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--out', type=Path, default=ROOT / 'out' / 'plain_loop')
    p.add_argument('--data', type=Path, default=None, help='the converted samples (default: OUT/data)')
    p.add_argument('--save-every', type=int, default=10)
    p.add_argument('--lr', type=float, default=3e-3)
    p.add_argument('--world-size', type=int, default=1,
                   help='ranks (processes on this machine, gloo); a run may resume on another number')
    p.add_argument('--port', type=int, default=29517, help='the ranks\' rendezvous port (--world-size > 1)')
    p.add_argument('--hold-at', type=int, default=None,
                   help='after this step, wait to be killed (how the test kills a run mid-way)')
    args = p.parse_args()
    convert_samples(args.data or args.out / 'data')
    args.out.mkdir(parents=True, exist_ok=True)
    if args.world_size == 1:
        train(0, args)
    else:
        torch.multiprocessing.spawn(train, args=(args,), nprocs=args.world_size)


def train(rank: int, args: argparse.Namespace) -> None:
    world = args.world_size
    if world > 1:  # what torchrun would set; build_loader reads RANK / WORLD_SIZE too
        os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(args.port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        dist.init_process_group('gloo', rank=rank, world_size=world)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one thread: the same float sums in every run
    data = args.data or args.out / 'data'
    ckpt, log_path = args.out / 'checkpoint.pt', args.out / 'samples.jsonl'

    loader = foundrymix.build_loader(data_config(data), rank=rank, world_size=world)
    model = GPT(vocab=8192, max_seq_len=loader.plan.max_seq_len)  # the bundled tokenizer's vocabulary
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step = 0
    if ckpt.exists():  # resume: weights, optimizer moments, and the loader's position
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state['model'])
        optimizer.load_state_dict(state['optimizer'])
        loader.load_state_dict(state['loader'])
        step = state['step']
        if rank == 0:
            print(f'resumed at step {step} (global batch {loader.position.batch}) on {world} rank(s)')
    if rank == 0:
        lines = log_path.read_text().splitlines()[:step] if log_path.exists() else []
        log_path.write_text(''.join(line + '\n' for line in lines))  # a killed run's later steps go
    ddp = DDP(model) if world > 1 else model  # the same initial weights on every rank (the seed)

    for batch in loader:
        loss = ddp(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        rows = {k: gather(batch[k], world) for k in ('stream_id', 'sample_id')}  # the global batch
        if rank == 0:
            with open(log_path, 'a') as log:
                log.write(json.dumps({'step': step, 'stage': int(batch['stage_id'][0]), 'loss': loss.item(),
                                      'stream': rows['stream_id'], 'sample': rows['sample_id']}) + '\n')
            if step % args.save_every == 0:
                save(ckpt, {'model': model.state_dict(), 'optimizer': optimizer.state_dict(),
                            'loader': loader.state_dict(), 'step': step})
            if step % 12 == 0:
                print(f'step {step}: loss {loss.item():.4f}; rows so far {loader.samples_per_stream()}')
            if step == args.hold_at:
                signal.pause()
    if rank == 0:
        torch.save(model.state_dict(), args.out / 'final.pt')
        print(f'done: {step} steps; rows per stream {loader.samples_per_stream()}')
    if world > 1:
        dist.destroy_process_group()


def gather(values: torch.Tensor, world: int) -> list[int]:
    """Every rank's values, rank after rank (the global batch's order)."""
    if world == 1:
        return values.tolist()
    parts = [torch.empty_like(values) for _ in range(world)]
    dist.all_gather(parts, values)
    return torch.cat(parts).tolist()


if __name__ == '__main__':
    main()

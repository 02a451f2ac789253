"""The fused loss under FSDP2 on two CPU ranks (gloo): ``fully_shard`` per block and on the root, as
Composer's FSDP2 wraps, and ``CausalLM.loss`` reading the output layer's weight after the forward.
Each rank's gradients, gathered whole, equal the unsharded model's on the same batch (float32, to
rounding, times the ranks' reduction): the output layer's gradient reaches its shards although it is
computed outside ``forward``.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port

from foundrymix.format.schema import TokenizerInfo
from foundrymix.train.model import CausalLM, ModelSpec, build_hf_model

TOK = TokenizerInfo(name='t', vocab_size=64, fingerprint='f', bos_id=None, eos_id=0, pad_id=1, add_bos=False)
LLAMA = {'type': 'llama', 'hidden_size': 32, 'intermediate_size': 64, 'num_hidden_layers': 2,
         'num_attention_heads': 2, 'max_position_embeddings': 16, 'fused_loss': True}


def model() -> CausalLM:
    torch.manual_seed(1)
    return CausalLM(build_hf_model(ModelSpec.from_dict(LLAMA), TOK, 16), fused_loss=True).train()


def batch() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ids = torch.randint(2, 64, (2, 16))
    labels = ids.clone()
    labels[:, :5] = -100  # a prompt: no loss there
    return {'input_ids': ids, 'labels': labels, 'position_ids': torch.arange(16).repeat(2, 1),
            'attention_mask': torch.ones_like(ids)}


def rank_main(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    dist.init_process_group('gloo', rank=rank, world_size=2)
    try:
        sharded = model()
        mesh = init_device_mesh('cpu', (2,))
        for layer in sharded.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        loss = sharded.loss(sharded(batch()), batch())
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}
        if rank == 0:
            torch.save({'loss': loss.detach(), 'grads': grads}, out)
        dist.barrier()  # neither rank leaves while the other is in a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks
def test_fused_loss_under_fully_shard_gives_the_unsharded_gradients(tmp_path):
    out = str(tmp_path / 'rank0.pt')
    ranks = mp.spawn(rank_main, args=(free_port(), out), nprocs=2, join=False)
    deadline = time.monotonic() + 240
    while not ranks.join(timeout=5):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail('the two gloo ranks did not finish in 240 s')
    got = torch.load(out, weights_only=False)
    plain = model()
    loss = plain.loss(plain(batch()), batch())
    loss.backward()
    want = {n: p.grad for n, p in plain.named_parameters()}
    assert got['grads'].keys() == want.keys() and len(want) == 21
    torch.testing.assert_close(got['loss'], loss.detach())
    # both ranks trained the same batch: FSDP2 reduces their gradients (gloo: summed, so 2x; an
    # average on NCCL), the same for every parameter -- a block's, computed in FSDP's forward, sets it
    block = 'model.model.layers.0.self_attn.q_proj.weight'
    factor = float((got['grads'][block].norm() / want[block].norm()).round())
    assert factor in (1.0, 2.0)
    for name, grad in want.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(got['grads'][name], grad * factor, rtol=1e-5, atol=1e-6, msg=name)

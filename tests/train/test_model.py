"""The model wrapper: document attention really keeps packed documents apart; loss uses labels."""

from __future__ import annotations

import pytest
import torch

from foundrymix.format.schema import TokenizerInfo, decode_row, encode_row
from foundrymix.loader.collate import collate
from foundrymix.train.model import CausalLM, ModelSpec, build_hf_model

TOK = TokenizerInfo(name='t', vocab_size=64, fingerprint='f', bos_id=None, eos_id=0, pad_id=1, add_bos=False)
SEQ = 16
SMALL = {
    'llama': {'hidden_size': 32, 'intermediate_size': 64, 'num_hidden_layers': 2, 'num_attention_heads': 2,
              'max_position_embeddings': SEQ},
    'gpt2': {'n_embd': 32, 'n_layer': 2, 'n_head': 2, 'n_positions': SEQ},
}


def batch_of(first_doc: list[int]) -> dict[str, torch.Tensor]:
    """One row: a 6-token document, then a 7-token document, then 3 padding tokens."""
    ids = first_doc + [10, 11, 12, 13, 14, 15, 16] + [1, 1, 1]
    row = encode_row(ids, [(0, 13)], [6, 7], 'uint16')
    return dict(collate([{**decode_row(row), 'stream_id': 0, 'sample_id': 0}]))


def model_for(kind: str, attention: str) -> CausalLM:
    torch.manual_seed(0)
    spec = ModelSpec.from_dict({'type': kind, 'attention': attention, **SMALL[kind]})
    return CausalLM(build_hf_model(spec, TOK, SEQ), attention=spec.attention).eval()


def logits_with_two_first_documents(kind: str, attention: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of two rows that differ only in their first document."""
    model = model_for(kind, attention)
    with torch.no_grad():
        return model(batch_of([2, 3, 4, 5, 6, 0])).logits, model(batch_of([7, 8, 9, 20, 21, 0])).logits


@pytest.mark.parametrize('kind', ['llama', 'gpt2'])
def test_document_attention_isolates_packed_documents(kind):
    a, b = logits_with_two_first_documents(kind, 'document')
    assert not torch.allclose(a[0, :6], b[0, :6])           # the first document changed ...
    torch.testing.assert_close(a[0, 6:13], b[0, 6:13], rtol=0, atol=1e-5)  # ... the second did not see it


@pytest.mark.parametrize('kind', ['llama', 'gpt2'])
def test_causal_attention_sees_across_documents(kind):
    a, b = logits_with_two_first_documents(kind, 'causal')
    assert not torch.allclose(a[0, 6:13], b[0, 6:13])


def test_loss_is_mean_cross_entropy_over_labelled_positions():
    model = model_for('llama', 'document')
    batch = batch_of([2, 3, 4, 5, 6, 0])
    out = model(batch)
    logits, labels = out.logits[0, :-1], batch['labels'][0, 1:]
    keep = labels != -100
    expected = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
    torch.testing.assert_close(model.loss(out, batch), expected)
    assert int(keep.sum()) == 12  # 13 labelled tokens, the first has no predecessor


@pytest.mark.parametrize('kind', ['llama', 'gpt2'])
def test_loss_is_bitwise_the_models_own_and_rows_sum_to_it(kind):
    """The training loss equals the loss transformers computes when given ``labels`` (bitwise),
    and the per-row sums it leaves on the outputs add up to it (two rows: different targets)."""
    model = model_for(kind, 'document')  # eval(): gpt2's dropout would draw two different masks
    rows = [batch_of([2, 3, 4, 5, 6, 0]), batch_of([7, 8, 9, 20, 21, 0])]
    batch = {k: torch.cat([rows[0][k], rows[1][k]]) for k in rows[0]}
    batch['labels'][1, :8] = -100  # the second row: a prompt, no loss on its first 8 tokens
    out = model(batch)
    loss = model.loss(out, batch)
    own = model.model(input_ids=batch['input_ids'], position_ids=batch['position_ids'], labels=batch['labels'])
    assert torch.equal(loss, own.loss) and loss.requires_grad
    assert out.row_loss.targets.tolist() == [12, 5]
    torch.testing.assert_close(out.row_loss.loss_sum.sum() / 17, loss, rtol=1e-6, atol=0)
    for r in range(2):  # each row alone: transformers' mean over its targets
        alone = model.model(input_ids=batch['input_ids'][r:r + 1], position_ids=batch['position_ids'][r:r + 1],
                            labels=batch['labels'][r:r + 1]).loss
        torch.testing.assert_close(out.row_loss.loss_sum[r] / out.row_loss.targets[r], alone, rtol=1e-6, atol=0)

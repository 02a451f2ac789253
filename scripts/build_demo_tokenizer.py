"""Train the bundled demo tokenizer (byte-level BPE, 8,192 tokens) on the bundled samples.

Why a trained tokenizer is bundled: the demo and the tests must run with no hub
download, and a small vocabulary keeps the demo model small (the embedding is most
of a tiny model). It is GPT-2 shaped: byte-level BPE, no BOS, ``<|endoftext|>`` as
EOS, plus ChatML markers so chat conversion has a real chat template to use.

Run: ``python scripts/build_demo_tokenizer.py`` (deterministic; rewrites
``foundrymix/assets/tokenizers/foundrymix-bpe-8k``).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / 'foundrymix' / 'assets' / 'tokenizers' / 'foundrymix-bpe-8k'
SPECIALS = ['<|endoftext|>', '<|pad|>', '<|im_start|>', '<|im_end|>']
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def texts():
    samples = ROOT / 'data' / 'samples'
    with open(samples / 'arxiv_sample.jsonl', encoding='utf-8') as f:
        for line in f:
            yield json.loads(line)['text']
    with open(samples / 'dolly_hhrlhf_sample.jsonl', encoding='utf-8') as f:
        for line in f:
            row = json.loads(line)
            yield row['prompt'] + row['response']


def main() -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token='<|endoftext|>',
                                   pad_token='<|pad|>', unk_token=None, bos_token=None,
                                   model_max_length=1 << 20)
    fast.chat_template = CHAT_TEMPLATE
    OUT.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(OUT))
    print(f'wrote {OUT} (vocab {len(fast)})')


if __name__ == '__main__':
    main()

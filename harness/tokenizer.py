"""A tiny byte-level BPE tokenizer.json with a ChatML chat template, trained in a moment with `tokenizers` (in
requirements-test.txt): what a model's `tokenizer_path` names in tests and measurements without a download."""

from __future__ import annotations

import json
import os

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRAINING = ["the quick brown fox jumps over the lazy dog " * 20, "system user assistant tools " * 20]


def tiny_tokenizer(folder: str, texts: list[str] | None = None, vocab_size: int = 400):
    """Train one on `texts` (default: a few English words), save `tokenizer.json` and a `tokenizer_config.json`
    with TEMPLATE and bos `<s>` in `folder` (a model's tokenizer_path), and return the tokenizer."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<s>", "<|im_start|>", "<|im_end|>", "[UNK]"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts or TRAINING, trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": TEMPLATE, "bos_token": "<s>"}, f)
    return tok

"""Build the e2e suite's tiny random-weight Llama and its tokenizer, offline and deterministically.

Run with the vLLM venv's python (it has torch, transformers and tokenizers): `build_model.py OUT_DIR`.
The tokenizer is a byte-level BPE (vocab 4096) trained on this Python's own standard-library sources,
with a ChatML chat template; the model is a LlamaForCausalLM (hidden 256, 2 layers, 4 heads, 2 KV heads)
with weights from a fixed seed, saved as bf16 safetensors. Output is gibberish: tests assert on shapes and
compare greedy logprobs, never text. The build goes to a temporary folder renamed into place at the end,
so an interrupted build never leaves a half model behind.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sys
import sysconfig

VOCAB = 4096
MAX_LEN = 512
SEED = 1234
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus() -> list[str]:
    """The top-level modules of this interpreter's standard library, in a fixed order (a few MB)."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if len(files) < 50:
        raise SystemExit(f"build_model: too few standard-library sources found ({len(files)}) to train a tokenizer")
    return files


def build_tokenizer(out: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(corpus(), trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL[0],
        "eos_token": SPECIAL[2],
        "pad_token": SPECIAL[0],
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_LEN,
        "chat_template": CHATML,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump(
            {"bos_token": SPECIAL[0], "eos_token": SPECIAL[2], "pad_token": SPECIAL[0]}, f, indent=2, sort_keys=True
        )


def build_model(out: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0}, f, indent=2, sort_keys=True)


def digest(folder: str) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            h.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def main() -> None:
    out = os.path.abspath(sys.argv[1])
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    build_tokenizer(tmp)
    build_model(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    print(f"build_model: {out} sha256 {digest(out)}")


if __name__ == "__main__":
    main()

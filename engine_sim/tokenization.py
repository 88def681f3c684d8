"""vLLM's /tokenize and /detokenize (vllm/entrypoints/serve/tokenize in 0.32), on the simulator's tokenizer.

A prompt's ids are those the inference routes use (`tokens.text_token_ids`): a conversation is rendered by the
simulator's chat template first, without its generation prompt when `add_generation_prompt` is false, and with
its last message left open (no generation prompt after it) when `continue_final_message` is true. Neither adds special tokens (the ChatML
family adds no BOS), so `add_special_tokens` changes nothing. `token_strs` are the ids' texts, each as it
decodes alone. Detokenizing takes any id (an id without text here decodes to a `<|id|>` marker). vLLM 0.32
checks no length here: a prompt past `max_model_len` is counted all the same.
"""

from __future__ import annotations

from aiohttp import web

from . import tokens as T
from .json_text import dumps
from .request import check_served_model, validated
from .state import SimState

GENERATION_PROMPT = "<|im_start|>assistant\n"
END_OF_MESSAGE = "<|im_end|>\n"


def tokenize(sim: SimState, body: dict, headers: dict) -> web.Response:
    if "messages" in body:
        r = validated("tokenize_chat", body)
        text = T.render_chat_prompt(r.messages, tools=r.tools)
        if r.continue_final_message and r.messages:  # the last message goes on: no new turn after it
            text = text.removesuffix(GENERATION_PROMPT).removesuffix(END_OF_MESSAGE)
        elif not r.add_generation_prompt:
            text = text.removesuffix(GENERATION_PROMPT)
    else:
        r = validated("tokenize", body)
        text = r.prompt
    check_served_model(r.model, sim.cfg)
    ids = T.text_token_ids(text, sim.cfg.bytes_per_token)
    answer = {
        "count": len(ids),
        "max_model_len": sim.cfg.max_model_len,
        "tokens": ids,
        "token_strs": [T.decode_token_ids([i]) for i in ids] if r.return_token_strs else None,
    }
    return web.Response(text=dumps(answer), content_type="application/json", headers=headers)


def detokenize(sim: SimState, body: dict, headers: dict) -> web.Response:
    r = validated("detokenize", body)
    check_served_model(r.model, sim.cfg)
    answer = {"prompt": T.decode_token_ids(r.tokens)}
    return web.Response(text=dumps(answer), content_type="application/json", headers=headers)

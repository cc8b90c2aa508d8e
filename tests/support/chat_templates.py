"""Chat templates and tokenizers for the gateway's prompt-path tests, and the oracles they are
checked against: a small byte-level BPE tokenizer directory, ChatML and a content-looping
template, the conversation vLLM builds from a client's messages (rebuilt from vLLM's
``chat_utils``, not through mesh) and what ``transformers`` renders from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>{{ tc.function | tojson }}</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GENERATION_TAIL = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
# loops over message['content'] and reads each part's type: vLLM detects "openai"
PARTS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% for p in m['content'] %}[{{ p['type'] }}]{{ p['text'] }}"
         "{% endfor %}<|im_end|>\n{% endfor %}" + GENERATION_TAIL)

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "hello world"},
    {"role": "user", "content": [{"type": "text", "text": "the quick"}, {"type": "text", "text": "brown fox", "x": 1}]},
    {"role": "assistant", "content": None},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "warm"}]},
    {"role": "user", "content": ""},
    {"role": "assistant", "content": "jumps over"},
]


def build_tokenizer(directory: Path, template: str = CHATML, saved_limits: bool = False) -> Path:
    """A small byte-level BPE ``tokenizer.json`` (merges cross word and turn boundaries) + config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    corpus = ["hello world the quick brown fox jumps over the lazy dog user assistant system tool\n\n  "] * 20
    tok.train_from_iterator(corpus, trainer)
    if saved_limits:  # as some exported tokenizers are saved: transformers ignores both unless asked
        tok.enable_truncation(8)
        tok.enable_padding(length=12, pad_id=2, pad_token="<|endoftext|>")
    tok.save(str(directory / "tokenizer.json"))
    config = {"chat_template": template, "eos_token": "<|endoftext|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory



def vllm_conversation(messages: list[dict[str, Any]], content_format: str) -> list[dict[str, Any]]:
    """The messages vLLM hands to ``apply_chat_template`` (chat_utils ``_parse_chat_message_content``):
    a string becomes one text part and null no part; parts are rebuilt as {type, text}; "string"
    joins the texts with "\\n"; a tool message whose parts are all text is joined in either format."""
    out = []
    for m in messages:
        content = m.get("content")
        parts = [] if content is None else [{"type": "text", "text": content}] if isinstance(content, str) else content
        texts = [p["text"] for p in parts]
        if content_format == "string" or m["role"] == "tool":
            built: Any = "\n".join(texts)
        else:
            built = [{"type": "text", "text": t} for t in texts]
        out.append({**m, "content": built})
    return out


def hf_render(template: str, conversation: list[dict[str, Any]], tok_dir: Path, **kwargs: Any) -> str:
    """What ``transformers`` renders (``apply_chat_template``, as vLLM calls it) with the tokenizer in ``tok_dir``."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    hf.chat_template = template
    return str(hf.apply_chat_template(conversation, tokenize=False, **kwargs))

"""A tiny chat tokenizer and conversations for the chat-data tests (no network)."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "Four."},
     {"role": "user", "content": "And three plus three?"},
     {"role": "assistant", "content": "Six, of course."}],
    [{"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue is a colour."}],
] * 6  # fmt: skip


def make_chat_tokenizer(folder: Path) -> Path:
    """A BPE tokenizer (400 tokens) trained on :data:`CONVERSATIONS` with a ChatML
    template, saved as a model's tokenizer folder (needs ``transformers``)."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([m["content"] for c in CONVERSATIONS for m in c] * 3, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", additional_special_tokens=special[1:]
    )
    fast.chat_template = CHATML
    fast.save_pretrained(str(folder))
    return folder


def write_conversations(path: Path, conversations=CONVERSATIONS) -> Path:
    """``conversations`` as JSON Lines records ``{"messages": [...]}``."""
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path

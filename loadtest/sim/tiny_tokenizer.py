"""A small real tokenizer, built in-process: precise mode is tested without a model hub.

A byte-level BPE (so any text tokenizes, like a Llama-3 tokenizer) trained on a built-in corpus,
with Llama-style special tokens: `<s>` prepended to completions by the post-processor, `</s>`,
and one atomic token per chat role. `write_tiny_tokenizer(dir)` writes tokenizer.json, the chat
template and a tokenizer_config.json that transformers (and so vLLM) can load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
VOCAB_SIZE = 600  # small: training takes milliseconds; big enough that words are a few tokens

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = [
    "You are a meticulous assistant for a logistics company.",
    "Shipments leave the warehouse every morning and arrive within two days.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps.",
    "Please summarise the following document in three short sentences.",
    "Answer the question using only the context given above, and cite it.",
    "What is the status of order number 4821, and when will it be delivered?",
    "Caching the prefix of a prompt saves the time needed to compute it again.",
    "Routers send each request to the replica that already holds its cache.",
]


@dataclass(frozen=True)
class TinyTokenizerFiles:
    directory: Path
    tokenizer_json: Path
    chat_template: Path
    tokenizer_config: Path


def build_tiny_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[UNK, BOS, EOS, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def write_tiny_tokenizer(directory: str | Path) -> TinyTokenizerFiles:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tokenizer_json = d / "tokenizer.json"
    build_tiny_tokenizer().save(str(tokenizer_json))
    template = d / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    config = d / "tokenizer_config.json"
    config.write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "unk_token": UNK,
                "add_bos_token": True,
                "add_eos_token": False,
                "model_max_length": 4096,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    return TinyTokenizerFiles(d, tokenizer_json, template, config)

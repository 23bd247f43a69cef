"""Write a tiny random-weight Llama (config + safetensors) and its tokenizer to a directory.

Run with the engine's Python (it needs torch and transformers, which the gateway does not):
    .venv-engine/bin/python tests/engine/make_tiny_model.py DIR
Nothing is downloaded: the weights are random, the tokenizer is loadtest/sim/tiny_tokenizer.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from loadtest.sim.tiny_tokenizer import BOS, EOS, write_tiny_tokenizer  # noqa: E402

HIDDEN = 256  # 4 heads of 64: a head size every vLLM CPU attention backend supports
LAYERS = 2
MAX_POSITIONS = 4096


def main(directory: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(directory)
    files = write_tiny_tokenizer(out)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(files.tokenizer_json)).get_vocab_size()
    tok = Tokenizer.from_file(str(files.tokenizer_json))
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1])

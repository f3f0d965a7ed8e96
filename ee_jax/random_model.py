"""A tiny random Llama with a real byte-level tokenizer, for serving without a model file.

The HTTP server, its tests and `python -m bench.load http --random` need the whole text path
(encode, chat template, incremental decode) on a model that compiles in seconds. The tokenizer
is byte-level BPE with no merges: every Unicode string encodes (one token per UTF-8 byte), and
three special tokens give it an end of text and a ChatML chat template.

    model = random_model()                      # a LoadedModel
    llm = LLM(model)                            # or: ee-jax serve --model random
"""

from __future__ import annotations

import jax
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from ee_jax.models.config import ModelConfig
from ee_jax.models.llama import init_params
from ee_jax.models.loading import LoadedModel
from ee_jax.models.tokenizer import Tokenizer

NAME = "random"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> Tokenizer:
    """256 byte tokens (GPT-2's byte alphabet, ids 0-255) then the special tokens (256-258)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(alphabet)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    eos = backend.token_to_id(SPECIAL_TOKENS[0])
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=(eos,),
                     chat_template=CHAT_TEMPLATE)


def _byte_of(char: str) -> int:
    """GPT-2's byte-to-character map, inverted (printable bytes map to themselves)."""
    code = ord(char)
    if 33 <= code <= 126 or 161 <= code <= 172 or 174 <= code <= 255:
        return code
    # The other bytes are spelled 256, 257, ... in byte order.
    others = [b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255)]
    return others[code - 256]


def random_config(**overrides) -> ModelConfig:
    """4 layers, GQA, vocabulary = the byte tokenizer's 259 ids."""
    base = dict(vocab_size=256 + len(SPECIAL_TOKENS), d_model=48, n_layers=4, n_heads=4,
                n_kv_heads=2, head_dim=16, ffn_dim=96, max_position=8192, bos_token_id=None,
                eos_token_ids=(256,), name=NAME)
    base.update(overrides)
    return ModelConfig(**base)


def random_model(seed: int = 0, scale: float = 0.1, **overrides) -> LoadedModel:
    """A LoadedModel: random weights (`seed`) and the byte tokenizer. Greedy output is a
    deterministic function of the prompt, which is all the serving tests need."""
    cfg = random_config(**overrides)
    return LoadedModel(cfg, init_params(cfg, jax.random.PRNGKey(seed), scale=scale),
                       byte_tokenizer(), source=f"random (seed {seed})", name=None)

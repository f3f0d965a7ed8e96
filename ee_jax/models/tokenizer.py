"""Text <-> token ids for Llama-family models, built from a GGUF file or a Hugging Face folder.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust BPE), adding what serving needs on top: the
BOS/EOS/stop ids, the model's own chat template, and `IncrementalDecoder` for streaming.

    tok = Tokenizer.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    ids = tok.encode(prompt)

A GGUF file carries no `tokenizer.json`, only llama.cpp's metadata: the vocabulary
(`tokenizer.ggml.tokens`), the merges, each token's type, and `tokenizer.ggml.pre`, the *name* of
the pre-tokenizer (how text is cut into words before BPE runs). The name is mapped to a
pre-tokenizer here; a name we do not know raises `UnsupportedModelError` rather than silently
tokenizing differently from the way the model was trained.

Pre-tokenizers, and one deliberate choice (`compat`):

- "gpt2", "mpt", "olmo", and "default" (also used when the file names none): GPT-2's byte-level
  regex, as transformers applies it (llama.cpp's "default" is a looser legacy split).
- "llama-bpe" (and "llama3", "llama-v3", "falcon3", "pixtral"): Llama 3's regex (numbers in groups
  of up to three), then byte-level without a regex.
- "smollm" (and "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"): llama.cpp
  first splits off every digit (`\\p{N}`) and then applies GPT-2's regex to the stretches between
  digits -- the same as SmolLM2's own `tokenizer.json`,
  `Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False)]`.
  transformers, building a tokenizer from the same GGUF, ignores the name and applies GPT-2's
  regex alone. SmolLM2's vocabulary has no multi-character token containing an ASCII digit, so
  the two agree except where a run of two or more whitespace characters directly precedes a
  digit (`"a  1"`: SmolLM2 gives `a ĠĠ 1`, transformers `a Ġ Ġ 1`; also `"\\n\\n1"`, indented code
  starting with a number) or a space precedes a non-ASCII digit (`" ٤"`).
- "qwen2": Qwen2's regex (digits one at a time).

`compat="transformers"` (the default) reproduces transformers' GGUF tokenizer exactly, so that
end-to-end comparisons against transformers see the same ids. `compat="llama.cpp"` reproduces the
model's original tokenizer (and llama.cpp): digit splitting for the "smollm" family, and for
Llama 3 `ignore_merges` (a word that is itself a token is taken whole) and BOS when the file does
not say `tokenizer.ggml.add_bos_token`.

Vocabulary types (`tokenizer.ggml.token_type`): control and unknown tokens become special added
tokens (matched whole in text, dropped by `decode(skip_special_tokens=True)`); user-defined tokens
become plain added tokens (matched whole, kept on decode). A byte-level vocabulary may lack a
token for some bytes (SmolLM2 has none for U+0004, U+0006, U+0013, U+0014, U+0016, U+001D and the
UTF-8 lead bytes F1/F2); those bytes are dropped from the text, as transformers drops them.

`tokenizer.ggml.model == "llama"` (SentencePiece BPE with byte fallback) is built as transformers
builds it, merges derived from the scores when the file has none, except that
`tokenizer.ggml.add_space_prefix = false` is honoured (llama.cpp does; transformers always
prepends "▁"). Other tokenizer models (WordPiece "bert", Unigram "t5", "rwkv") raise
`UnsupportedModelError`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar, Literal

import gguf
import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from ee_jax.errors import EEJaxError, ModelLoadError, TokenizationError, UnsupportedModelError
from ee_jax.models.gguf_file import open_reader

Compat = Literal["transformers", "llama.cpp"]


def check_text(text, what: str = "text") -> str:
    """`text` if the tokenizer can encode it, else TokenizationError naming why. The Rust
    backend answers a lone surrogate (e.g. "\\ud800") with a bare TypeError."""
    if not isinstance(text, str):
        raise TokenizationError(f"the {what} is a {type(text).__name__}, not a str: pass text "
                                f"(or token ids where the API takes them)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizationError(
            f"the {what} is not valid Unicode: {text[e.start]!r} at character {e.start} "
            f"({e.reason}); send well-formed text (no lone surrogates)") from None
    return text


class ChatTemplateError(EEJaxError, ValueError):
    """A chat that cannot be rendered: no template, or the template rejected the messages."""


# llama.cpp's `tokenizer.ggml.token_type` values.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4  # then 5 unused, 6 byte

# Token texts llama.cpp treats as end-of-generation whenever the vocabulary has them.
_END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<|end▁of▁sentence|>",
)

_GPT2_PRE = frozenset({"default", "gpt2", "mpt", "olmo"})
_DIGITS_PRE = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
_LLAMA3_PRE = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"})
_QWEN2_PRE = frozenset({"qwen2"})

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class Tokenizer:
    """A model's tokenizer: encode, decode, special ids and chat template.

    Build one with `from_gguf` or `from_file`; the constructor takes an assembled
    `tokenizers.Tokenizer` whose post-processor already adds BOS/EOS as the model wants.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        extra_stop_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
    ):
        self.backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self._chat_template = chat_template
        self._compiled_template = None
        stops = list(self._eos_token_ids) + [int(i) for i in extra_stop_token_ids]
        for text in _END_OF_TURN_TOKENS:
            token_id = backend.token_to_id(text)
            if token_id is not None:
                stops.append(token_id)
        self._stop_token_ids = tuple(dict.fromkeys(stops))
        start = backend.encode("", add_special_tokens=True).ids
        self._add_bos_token = bos_token_id is not None and start[:1] == [bos_token_id]

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_gguf(cls, path_or_reader: str | os.PathLike | Any, *,
                  compat: Compat = "transformers") -> Tokenizer:
        """The tokenizer a GGUF file describes (a path, or an open `gguf.GGUFReader`).

        `compat` chooses whose reading of `tokenizer.ggml.pre` to follow where transformers and
        llama.cpp differ; see the module docstring.
        """
        if compat not in ("transformers", "llama.cpp"):
            raise ValueError(f"compat must be 'transformers' or 'llama.cpp', got {compat!r}")
        reader, where = _open_gguf(path_or_reader)
        meta = _GGUFMetadata(reader, where)
        kind = meta.get("tokenizer.ggml.model")
        if kind is None:
            raise ModelLoadError(
                f"{where} has no tokenizer metadata (tokenizer.ggml.model is missing); load the "
                "tokenizer from the model's tokenizer.json with Tokenizer.from_file instead"
            )
        tokens = meta.require("tokenizer.ggml.tokens")
        token_types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if len(token_types) != len(tokens):
            raise ModelLoadError(
                f"{where}: tokenizer.ggml.token_type has {len(token_types)} entries for "
                f"{len(tokens)} tokens"
            )
        if kind == "gpt2":
            backend, default_add_bos = _byte_level_bpe(meta, tokens, token_types, compat)
        elif kind == "llama":
            backend, default_add_bos = _sentencepiece_bpe(meta, tokens, token_types)
        else:
            raise UnsupportedModelError(
                f"{where}: tokenizer.ggml.model {kind!r} is not supported; ee-jax reads 'gpt2' "
                "(byte-level BPE) and 'llama' (SentencePiece BPE) tokenizers"
            )

        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        add_bos = meta.get("tokenizer.ggml.add_bos_token", default_add_bos)
        add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
        backend.post_processor = _bos_eos_processor(
            (tokens[bos], bos) if add_bos and bos is not None else None,
            (tokens[eos], eos) if add_eos and eos is not None else None,
        )
        extra_stops = [meta.get(k) for k in ("tokenizer.ggml.eot_token_id",
                                              "tokenizer.ggml.eom_token_id")]
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=() if eos is None else (eos,),
            extra_stop_token_ids=[i for i in extra_stops if i is not None],
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        """The tokenizer in a Hugging Face `tokenizer.json`, or a folder holding one.

        Beside it, `tokenizer_config.json` supplies the chat template, the BOS/EOS tokens and
        `add_bos_token`/`add_eos_token`; `chat_template.jinja` a template stored on its own; and
        `generation_config.json` more end-of-sequence ids.
        """
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ModelLoadError(f"no tokenizer.json at {file}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises plain Exception
            raise ModelLoadError(f"{file} is not a valid tokenizer.json: {e}") from e
        folder = file.parent
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")

        def token_id(name: str) -> int | None:
            token = config.get(name)
            if isinstance(token, Mapping):
                token = token.get("content")
            return backend.token_to_id(token) if isinstance(token, str) else None

        bos, eos = token_id("bos_token"), token_id("eos_token")
        if "add_bos_token" in config or "add_eos_token" in config:
            backend.post_processor = _bos_eos_processor(
                (backend.id_to_token(bos), bos) if config.get("add_bos_token") and bos is not None
                else None,
                (backend.id_to_token(eos), eos) if config.get("add_eos_token") and eos is not None
                else None,
            )
        generation_eos = generation.get("eos_token_id")
        if isinstance(generation_eos, int):
            generation_eos = [generation_eos]
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=() if eos is None else (eos,),
            extra_stop_token_ids=generation_eos or (),
            chat_template=_chat_template_from_folder(config, folder),
        )

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS (and EOS) only if the model adds them and
        `add_special_tokens`. Special tokens written in the text are always matched whole."""
        return self.backend.encode(check_text(text), add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str],
                     add_special_tokens: bool = True) -> list[list[int]]:
        texts = [check_text(t, f"text {i}") for i, t in enumerate(texts)]
        encodings = self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (byte-level spelling, e.g. "Ġthe"), or None if out of range."""
        return self.backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ------------------------------------------------------------------ special ids

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the model's embedding rows)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def add_bos_token(self) -> bool:
        """Whether `encode(text)` starts with BOS."""
        return self._add_bos_token

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's declared end-of-sequence id(s)."""
        return self._eos_token_ids

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: EOS, the file's end-of-turn ids, and end-of-turn tokens such
        as `<|im_end|>`/`<|eot_id|>`/`<|endoftext|>` where the vocabulary has them (llama.cpp's
        rule)."""
        return self._stop_token_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def _special_token(self, token_id: int | None) -> str:
        token = None if token_id is None else self.backend.id_to_token(token_id)
        return token or ""

    # ------------------------------------------------------------------ chat

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` with the model's own Jinja template, as transformers'
        `apply_chat_template(..., tokenize=False)` does. Extra keyword arguments (`tools`,
        `documents`, template-specific flags) are passed to the template."""
        if not self._chat_template:
            raise ChatTemplateError(
                "this model has no chat template (no tokenizer.chat_template in the GGUF, no "
                "chat_template in tokenizer_config.json); format the prompt yourself"
            )
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self._chat_template)
        variables = {
            "bos_token": self._special_token(self._bos_token_id),
            "eos_token": self._special_token(self._eos_token_ids[0] if self._eos_token_ids
                                             else None),
            "tools": None,
            "documents": None,
            **kwargs,
        }
        try:
            return self._compiled_template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected these messages: {e}") from e

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self._bos_token_id}, "
                f"eos={self._eos_token_ids}, add_bos={self._add_bos_token})")


class IncrementalDecoder:
    """Turns a stream of ids into text deltas that never split a character.

    A byte-level token can end in the middle of a multi-byte UTF-8 character; decoding it alone
    gives U+FFFD. `push` returns only text that is complete, holding the rest back until the
    bytes that finish it arrive; `finish` returns whatever is left. The deltas join to
    `tokenizer.decode(all_ids)`.

        stream = IncrementalDecoder(tok)
        for token_id in generated:
            print(stream.push(token_id), end="")
        print(stream.finish())

    Each step decodes only the ids since the last complete point (the window starts one emitted
    chunk back, so tokenizers that strip or merge at word starts see the same context).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoding window
        self._read = 0  # ids before this are already emitted

    def push(self, ids: int | Iterable[int]) -> str:
        """Add one id or several; return the newly completed text (possibly "")."""
        if isinstance(ids, int):
            self._ids.append(ids)
        else:
            self._ids.extend(int(i) for i in ids)
        prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix, len(self._ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text):]

    def finish(self) -> str:
        """The text still held back (an unfinished character decodes as U+FFFD)."""
        prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix, len(self._ids))
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text):]

    def _decode(self, start: int, stop: int) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip)


# ---------------------------------------------------------------------- GGUF metadata


def _open_gguf(path_or_reader) -> tuple[Any, str]:
    if isinstance(path_or_reader, gguf.GGUFReader):
        return path_or_reader, "the GGUF file"
    return open_reader(path_or_reader), str(path_or_reader)


class _GGUFMetadata:
    """Typed access to a GGUFReader's key/value fields."""

    def __init__(self, reader, where: str):
        self._fields = reader.fields
        self._types = gguf.GGUFValueType
        self.where = where

    def get(self, name: str, default: Any = None) -> Any:
        field = self._fields.get(name)
        if field is None or not field.types:
            return default
        value_type, string = field.types[0], self._types.STRING
        try:
            if value_type == self._types.ARRAY:
                if field.types[-1] == string:
                    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
                return [v for i in field.data for v in field.parts[i].tolist()]
            if value_type == string:
                return bytes(field.parts[-1]).decode("utf-8")
            return field.parts[-1].tolist()[0]
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{self.where}: {name} is not valid UTF-8: {e}") from e

    def require(self, name: str) -> Any:
        value = self.get(name)
        if value is None:
            raise ModelLoadError(f"{self.where} has no {name}, which its tokenizer needs")
        return value


def _vocab(tokens: Sequence[str], spell=None) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(spell(token) if spell else token, index)
    return vocab


def _merges(meta: _GGUFMetadata, where: str) -> list[tuple[str, str]] | None:
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        return None
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ModelLoadError(f"{where}: malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((parts[0], parts[1]))
    return pairs


def _added_tokens(tokens: Sequence[str], token_types: Sequence[int], vocab: Mapping[str, int]):
    """Control/unknown tokens as special added tokens, user-defined ones as plain added tokens;
    only those whose spelling is their own id (so adding them never grows the vocabulary)."""
    special, plain = [], []
    for index, (token, kind) in enumerate(zip(tokens, token_types, strict=True)):
        if vocab.get(token) != index:
            continue
        if kind in (_CONTROL, _UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False))
        elif kind == _USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    return special, plain


def _byte_level_bpe(meta: _GGUFMetadata, tokens, token_types, compat: Compat):
    where = meta.where
    pre = meta.get("tokenizer.ggml.pre", "default")
    llama_cpp = compat == "llama.cpp"
    if pre in _GPT2_PRE or (pre in _DIGITS_PRE and not llama_cpp):
        pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in _DIGITS_PRE:
        pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT
        pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        known = sorted(_GPT2_PRE | _DIGITS_PRE | _LLAMA3_PRE | _QWEN2_PRE)
        raise UnsupportedModelError(
            f"{where}: pre-tokenizer tokenizer.ggml.pre = {pre!r} is not supported (known: "
            f"{', '.join(known)}); load the model's tokenizer.json with Tokenizer.from_file"
        )

    # Normal tokens are spelled in GPT-2's byte alphabet; a token written with other characters
    # (as some converters store added tokens) is respelled, unless it is matched whole anyway.
    whole = {_CONTROL, _UNKNOWN, _USER_DEFINED}
    spelled = [
        t if set(t) <= _BYTE_ALPHABET or kind in whole
        else "".join(_BYTE_TO_CHAR[b] for b in t.encode("utf-8"))
        for t, kind in zip(tokens, token_types, strict=True)
    ]
    vocab = _vocab(spelled)
    merges = _merges(meta, where)
    if merges is None:
        raise ModelLoadError(
            f"{where} has a byte-level BPE vocabulary but no tokenizer.ggml.merges")
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
        ignore_merges=llama_cpp and pre in _LLAMA3_PRE,
    ))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    _add_whole_tokens(backend, spelled, token_types, vocab)
    # llama.cpp adds BOS for Llama 3 vocabularies unless the file says otherwise.
    return backend, llama_cpp and pre in _LLAMA3_PRE


def _sentencepiece_bpe(meta: _GGUFMetadata, tokens, token_types):
    """SentencePiece BPE with byte fallback, as transformers' `LlamaTokenizer` builds it."""
    where = meta.where
    vocab = _vocab(tokens)
    merges = _merges(meta, where)
    if merges is None:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelLoadError(f"{where} has a SentencePiece vocabulary without merges or "
                                 "one score per token (tokenizer.ggml.scores)")
        merges = _merges_from_scores(tokens, token_types, scores, vocab)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    add_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True,
    ))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    _add_whole_tokens(backend, tokens, token_types, vocab)
    return backend, True  # llama.cpp and transformers add BOS unless the file says otherwise


def _merges_from_scores(tokens, token_types, scores, vocab) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by the vocabulary: every split of a normal piece into
    two normal pieces, best-scored result first (transformers' `generate_merges` order)."""
    normal = {t for t, kind in zip(tokens, token_types, strict=True) if kind == _NORMAL}
    merges = []
    for token, score in zip(tokens, scores, strict=True):
        if token not in normal:
            continue
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in normal and token[i:] in normal]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_whole_tokens(backend, tokens, token_types, vocab) -> None:
    special, plain = _added_tokens(tokens, token_types, vocab)
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)


def _bos_eos_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None):
    """A post-processor adding BOS and/or EOS, each given as (token, id), around the text."""
    single, specials = "$A", []
    if bos is not None:
        single = f"{bos[0]}:0 {single}"
        specials.append(bos)
    if eos is not None:
        single = f"{single} {eos[0]}:0"
        specials.append(eos)
    pair = single.replace("$A", "$A $B:1") if specials else "$A $B:1"
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=list(dict.fromkeys(specials)))


def _gpt2_byte_spelling() -> list[str]:
    """GPT-2's printable spelling of each byte value (printable Latin-1 bytes stand for
    themselves, the others map to U+0100 onwards in order)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    spelling, extra = [], 0
    for byte in range(256):
        if byte in printable:
            spelling.append(chr(byte))
        else:
            spelling.append(chr(256 + extra))
            extra += 1
    return spelling


_BYTE_TO_CHAR = _gpt2_byte_spelling()
_BYTE_ALPHABET = frozenset(_BYTE_TO_CHAR)


# ---------------------------------------------------------------------- HF folder helpers


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


def _chat_template_from_folder(config: Mapping[str, Any], folder: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if template:
        return template
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    return _read_json(folder / "chat_template.json").get("chat_template")


# ---------------------------------------------------------------------- chat template


def _compile_template(source: str):
    """A sandboxed Jinja environment with the globals transformers gives chat templates."""
    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
        for rendering it is a no-op."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser):
            next(parser.stream)  # the `generation` name
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which templates do not expect.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the model's chat template is not valid Jinja: {e}") from e

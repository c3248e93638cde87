"""ultrafast.tokenizer against Hugging Face's tokenizer built from the same GGUF file."""

from __future__ import annotations

import numpy as np
import pytest

from ultrafast import pull
from ultrafast.tokenizer import StreamDecoder, Tokenizer, TokenizerError

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    if x:\n\treturn x * 2\n    return None\n",
    "for (int i = 0; i < n; ++i) {\n        sum += a[i];\n}",
    "numbers: 1234567 3.14159 -42 0x1F 1,000,000",
    "中文文本，日本語のテキスト、한국어 텍스트",
    "emoji: 😀👍🏽🇫🇷 👨‍👩‍👧 ✨",
    "many   spaces    and\n\n\nnewlines\r\n\ttabs  \t end   ",
    "I don't think they'll've done it; she's sure we're OK. I'M LOUD, YOU'RE NOT",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text <|im_end|>",
    "  leading spaces",
    "trailing newline\n",
    "",
    " ",
    "Ünïcödé àccents — “quotes” … ½ ©",
    "<tool_call>{\"name\": \"f\"}</tool_call>",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be nice."},
        {"role": "user", "content": "Write a haiku about 🦀."},
        {"role": "assistant", "content": "Shell on the seafloor\nsideways steps"},
        {"role": "user", "content": "Another, in 日本語 please."},
    ],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city — in °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-0.5b"])
def pair(request):
    """(ours, Hugging Face's) tokenizer for one cached model."""
    transformers = pytest.importorskip("transformers")
    name = request.param
    if not pull.is_pulled(name) and not pull.model_path(name).is_file():
        pytest.skip(f"{name} is not in {pull.model_path(name).parent}")
    path = pull.model_path(name)
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return Tokenizer.from_gguf(path), hf


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_hf(pair, text):
    ours, hf = pair
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.decode(ids) == text == hf.decode(ids)


def test_metadata(pair):
    ours, hf = pair
    assert ours.vocab_size == len(hf)
    assert ours.bos_id == hf.bos_token_id
    assert hf.eos_token_id in ours.eos_ids
    assert hf.convert_tokens_to_ids("<|im_end|>") in ours.eos_ids
    assert ours.encode("hi", add_bos=True) == [ours.bos_id] + ours.encode("hi")
    special = "<|im_start|>user\nhi<|im_end|>"
    assert ours.decode(ours.encode(special), skip_special=True) == hf.decode(hf.encode(special), skip_special_tokens=True)
    assert ours.token_str(ours.encode("hello")[0]) == hf.decode(hf.encode("hello")[:1])


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_hf(pair, conversation):
    ours, hf = pair
    for add in (True, False):
        expected = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add)
        assert ours.apply_chat_template(conversation, add_generation_prompt=add) == expected


def test_chat_template_with_tools_matches_hf(pair):
    ours, hf = pair
    conversation = CONVERSATIONS[1]
    expected = hf.apply_chat_template(conversation, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(conversation, tools=TOOLS) == expected


def test_hf_dir_matches_gguf(pair, tmp_path):
    ours, hf = pair
    hf.save_pretrained(tmp_path)
    folder = Tokenizer.from_hf_dir(tmp_path)
    assert folder.vocab_size == ours.vocab_size and folder.bos_id == ours.bos_id
    assert ours.eos_ids <= folder.eos_ids
    for text in TEXTS:
        assert folder.encode(text) == ours.encode(text)
    assert folder.apply_chat_template(CONVERSATIONS[2]) == ours.apply_chat_template(CONVERSATIONS[2])


@pytest.mark.parametrize("text", [TEXTS[5], TEXTS[6], "mixed: héllo 中文 😀!\n" * 3])
def test_stream_decoder(pair, text):
    ours, _ = pair
    ids = ours.encode(text)
    stream = ours.stream_decoder()
    assert isinstance(stream, StreamDecoder)
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == ours.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


# ---- a sentencepiece ("llama") vocabulary, written to a tiny GGUF -----------------------------

def _write_sentencepiece_gguf(path):
    import gguf

    pieces = ["\u2581", "\u2581h", "\u2581he", "ll", "llo", "\u2581hello", "\u2581w", "or", "\u2581wor", "ld",
              "\u2581world", "e", "h", "l", "o", "w", "r", "d", "\u2581t", "\u2581the", "th", "t"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["<|user|>"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(4)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_matches_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    _write_sentencepiece_gguf(tmp_path / "tiny.gguf")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    ours = Tokenizer.from_gguf(tmp_path / "tiny.gguf")
    assert ours.vocab_size == len(hf) and ours.add_bos and ours.eos_ids == {2}
    for text in ["hello world", " hello  the world", "héllo ✓ 😀 中", "<|user|>hello<s>", "", "hello\nworld\n"]:
        ids = ours.encode(text)
        assert ids == hf.encode(text)
        assert ours.decode(ids) == hf.decode(ids)
        if not text.startswith(" "):  # Metaspace only prepends "▁" where none is, as in transformers
            assert ours.decode(ids[1:]) == text
        stream = ours.stream_decoder()
        assert "".join([stream.push(i) for i in ids] + [stream.flush()]) == ours.decode(ids)
    assert ours.encode("hello", add_bos=False) == [264]


# ---- synthetic metadata: fallback template and error paths ------------------------------------

def _byte_level_meta(**overrides):
    tokens = [chr(c) for c in range(33, 127)] + ["Ġ", "Ġh", "hi", "<|im_start|>", "<|im_end|>"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 2) + [3, 3],
        "tokenizer.ggml.merges": ["Ġ h", "h i"],
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }
    meta.update(overrides)
    return {k: v for k, v in meta.items() if v is not None}


def test_synthetic_byte_level_and_chatml_fallback():
    tok = Tokenizer.from_gguf_metadata(_byte_level_meta(), "synthetic.gguf")
    im_start, im_end = tok.vocab_size - 2, tok.vocab_size - 1
    assert tok.encode("hi<|im_end|>") == [tok.vocab_size - 3, im_end]
    assert tok.bos_id is None and tok.eos_ids == {im_end} and tok.chat_template is None
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(rendered)[0] == im_start
    with pytest.raises(TokenizerError):
        tok.encode("x", add_bos=True)
    with pytest.raises(TokenizerError):
        tok.decode([tok.vocab_size])
    with pytest.raises(TokenizerError):
        tok.apply_chat_template([])


def test_template_raise_exception():
    meta = _byte_level_meta(**{"tokenizer.chat_template": "{{ raise_exception('no system role') }}"})
    tok = Tokenizer.from_gguf_metadata(meta, "synthetic.gguf")
    with pytest.raises(TokenizerError, match="no system role"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    bad = Tokenizer.from_gguf_metadata(_byte_level_meta(**{"tokenizer.chat_template": "{% if %}"}), "bad.gguf")
    with pytest.raises(TokenizerError, match="bad.gguf"):
        bad.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("overrides, match", [
    ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.tokens": []}, "tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model"),
    ({"tokenizer.ggml.model": "rwkv"}, "unsupported tokenizer model 'rwkv'"),
    ({"tokenizer.ggml.token_type": [1, 1]}, "token_type"),
    ({"tokenizer.ggml.eos_token_id": 10**6}, "outside the vocabulary"),
    ({"tokenizer.ggml.merges": ["a b c"]}, "merges"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.merges": None}, "score"),
])
def test_bad_metadata(overrides, match):
    with pytest.raises(TokenizerError, match=match) as info:
        Tokenizer.from_gguf_metadata(_byte_level_meta(**overrides), "broken.gguf")
    assert "broken.gguf" in str(info.value)


def test_empty_metadata_and_missing_hf_dir(tmp_path):
    with pytest.raises(TokenizerError, match="nothing.gguf"):
        Tokenizer.from_gguf_metadata({}, "nothing.gguf")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)

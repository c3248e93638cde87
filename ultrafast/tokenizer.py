"""Text <-> token ids, built from a GGUF file's tokenizer metadata or a Hugging Face model folder.

The GGUF path rebuilds the same `tokenizers.Tokenizer` that transformers builds for the file
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), so ids match it exactly. Chat templates are
rendered the way transformers' `apply_chat_template` renders them.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from types import MappingProxyType

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend


class TokenizerError(ValueError):
    pass


_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# `tokenizer.ggml.pre` -> split regex, as transformers maps them. Any other value (gpt-2, default,
# smollm, ...) gets the GPT-2 regex built into the ByteLevel pre-tokenizer, as in transformers.
_PRE_SPLITS = MappingProxyType({
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"], _LLAMA3),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O),
    "qwen35": _QWEN35, "tekken": _TEKKEN,
})
# Special tokens that end a turn in common chat templates (llama.cpp treats the same ones as end-of-generation).
_END_OF_TURN = frozenset(["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                          "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>", "<end_of_utterance>"])
_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
           " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_CONTROL, _USER_DEFINED = 3, 4


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _merges_from_vocab(vocab: dict[str, int], scores: dict[str, float] | None) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary (transformers' `generate_merges`), best first."""
    ranked = scores if scores is not None else vocab
    merges = []
    for piece, rank in ranked.items():
        local = [(piece[:i], piece[i:], rank) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=scores is not None)
    return [(left, right) for left, right, _ in merges]


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` tag; here it just renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class Tokenizer:
    def __init__(self, backend: _Backend, *, source: str, bos_id: int | None, eos_ids: set[int], add_bos: bool,
                 chat_template: str | None, special_tokens: dict[str, str]):
        self._backend, self.source = backend, source
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.add_bos, self.chat_template = bos_id, add_bos, chat_template
        ends = {i for i, t in backend.get_added_tokens_decoder().items() if t.special and t.content in _END_OF_TURN}
        self.eos_ids: frozenset[int] = frozenset(eos_ids | ends)
        self._special_tokens = dict(special_tokens)  # bos_token, eos_token, ... for chat templates

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path) -> Tokenizer:
        from . import gguf_file

        try:
            meta, _, _ = gguf_file.read(path)
        except gguf_file.GGUFFormatError as e:
            raise TokenizerError(f"{path}: {e}") from None
        return cls.from_gguf_metadata(meta, Path(path).name)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, object], source: str) -> Tokenizer:
        def get(key, kind, default=None):
            value = meta.get(f"tokenizer.ggml.{key}", default)
            if value is not None and not isinstance(value, kind):
                raise TokenizerError(f"{source}: tokenizer.ggml.{key} should be {kind.__name__}, got {type(value).__name__}")
            return value

        kind, tokens = get("model", str), get("tokens", list)
        if kind is None or not tokens:
            raise TokenizerError(f"{source}: no tokenizer metadata (tokenizer.ggml.model / tokenizer.ggml.tokens)")
        if not all(isinstance(t, str) for t in tokens):
            raise TokenizerError(f"{source}: tokenizer.ggml.tokens must be a list of strings")
        types = get("token_type", list, [])
        if types and len(types) != len(tokens):
            raise TokenizerError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        merges = get("merges", list)
        if merges is not None:
            merges = [tuple(m.split(" ")) for m in merges]
            if any(len(m) != 2 for m in merges):
                raise TokenizerError(f"{source}: malformed entry in tokenizer.ggml.merges")

        if kind == "gpt2":
            spelling = _byte_spelling()
            alphabet = set(spelling.values())
            vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i for i, t in enumerate(tokens)}
            bpe = models.BPE(vocab, merges if merges is not None else _merges_from_vocab(vocab, None),
                             dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
            backend = _Backend(bpe)
            split = _PRE_SPLITS.get(get("pre", str))
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else (
                pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
            backend.decoder = decoders.ByteLevel()
            add_bos_default = False
        elif kind == "llama":  # sentencepiece BPE with byte fallback, as transformers' LlamaTokenizer
            scores = get("scores", list)
            if merges is None and (scores is None or len(scores) != len(tokens)):
                raise TokenizerError(f"{source}: sentencepiece vocabulary without merges needs one score per token")
            vocab = {t: i for i, t in enumerate(tokens)}
            if merges is None:
                merges = _merges_from_vocab(vocab, dict(zip(tokens, map(float, scores))))
            backend = _Backend(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True, dropout=None))
            backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
            backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                                 decoders.Fuse(), decoders.Strip(" ", 1, 0)])
            alphabet, add_bos_default = None, True
        else:
            raise TokenizerError(f"{source}: unsupported tokenizer model {kind!r} (supported: gpt2, llama)")

        # Control tokens become special added tokens, user-defined ones plain added tokens, so both match whole.
        # In a byte-level vocabulary a "control" token outside the byte alphabet is a mislabel and is skipped.
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t, ty in zip(tokens, types) if ty == _CONTROL and (alphabet is None or set(t) <= alphabet)])
        backend.add_tokens([AddedToken(t, normalized=False, special=False)
                             for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])

        def token_id(key):
            value = get(f"{key}_token_id", int)
            if value is not None and not 0 <= value < len(tokens):
                raise TokenizerError(f"{source}: tokenizer.ggml.{key}_token_id {value} is outside the vocabulary")
            return value

        ids = {name: token_id(key) for name, key in
               [("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"), ("eot", "eot"), ("eom", "eom")]}
        special = {f"{n}_token": tokens[ids[n]] for n in ("bos", "eos", "unk", "pad") if ids[n] is not None}
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t in dict.fromkeys(special.values()) if t in vocab])
        add_bos = get("add_bos_token", bool, add_bos_default)
        template = meta.get("tokenizer.chat_template")
        return cls(backend, source=source, bos_id=ids["bos"], add_bos=add_bos and ids["bos"] is not None,
                   eos_ids={ids[n] for n in ("eos", "eot", "eom") if ids[n] is not None},
                   chat_template=template if isinstance(template, str) else None, special_tokens=special)

    @classmethod
    def from_hf_dir(cls, path) -> Tokenizer:
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise TokenizerError(f"{folder}: no tokenizer.json")

        def read_json(name):
            file = folder / name
            try:
                return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
            except (OSError, json.JSONDecodeError) as e:
                raise TokenizerError(f"{file}: {e}") from e

        backend = _Backend.from_file(str(folder / "tokenizer.json"))
        config, generation = read_json("tokenizer_config.json"), read_json("generation_config.json")
        special = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                special[name] = value
        bos_id = backend.token_to_id(special["bos_token"]) if "bos_token" in special else None
        eos_ids = {backend.token_to_id(special["eos_token"])} if "eos_token" in special else set()
        gen_eos = generation.get("eos_token_id")
        eos_ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # follow whatever the tokenizer.json post-processor does
            add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(backend, source=folder.name, bos_id=bos_id, add_bos=bool(add_bos) and bos_id is not None,
                   eos_ids={i for i in eos_ids if isinstance(i, int)},
                   chat_template=template if isinstance(template, str) else None, special_tokens=special)

    # ---- text <-> ids -------------------------------------------------------------------------
    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos):
            if self.bos_id is None:
                raise TokenizerError(f"{self.source}: add_bos requested but the tokenizer has no BOS token")
            ids.insert(0, self.bos_id)
        return ids

    def _check_ids(self, ids) -> list[int]:
        ids = list(ids)
        for i in ids:
            if not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise TokenizerError(f"{self.source}: token id {i!r} is outside the vocabulary (size {self.vocab_size})")
        return ids

    def decode(self, ids: list[int], *, skip_special: bool = False) -> str:
        return self._backend.decode(self._check_ids(ids), skip_special_tokens=skip_special)

    def grammar_vocab(self) -> tuple[list[str], bool]:
        """(every token as the vocabulary spells it, special tokens as "" since they never spell text; whether
        the spelling is byte-level (GPT-2's) rather than sentencepiece's with byte fallback): what a grammar
        library needs to know which bytes each token writes."""
        out = [""] * self.vocab_size
        for text, i in self._backend.get_vocab(with_added_tokens=True).items():
            out[i] = text
        for i, t in self._backend.get_added_tokens_decoder().items():
            if t.special:
                out[i] = ""
        dec = self._backend.decoder
        return out, isinstance(dec, decoders.ByteLevel)

    def token_str(self, id: int) -> str:
        return self.decode([id])

    def stream_decoder(self, *, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)

    # ---- chat templates -----------------------------------------------------------------------
    @cached_property
    def _template(self) -> jinja2.Template:
        def raise_exception(message):
            raise TokenizerError(f"{self.source}: chat template: {message}")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            return env.from_string(self.chat_template if self.chat_template is not None else _CHATML)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{self.source}: invalid chat template: {e}") from e

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, tools=None,
                            **extra) -> str:
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TokenizerError("messages must be a non-empty list of dicts")
        if tools is not None and (not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools)):
            raise TokenizerError("tools must be a list of JSON-schema dicts")
        chat = []
        for message in messages:
            if not isinstance(message, dict):
                raise TokenizerError(f"chat messages must be dicts, got {message!r}")
            message = {k: v for k, v in message.items() if v is not None}  # as transformers: drop None fields
            reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning") if k in message), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        variables = {"documents": None, **self._special_tokens, **extra}
        try:
            return self._template.render(messages=chat, tools=tools, add_generation_prompt=add_generation_prompt,
                                         **variables)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{self.source}: chat template failed: {e}") from e


class StreamDecoder:
    """Incremental detokenizer: text comes out once it is complete (no split UTF-8 sequences).

    It decodes a short window of recent ids and emits what the newest ids added, so decoders that
    depend on neighbouring tokens (byte fallback, sentencepiece's leading space) stay exact.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False):
        self._tok, self._skip = tokenizer, skip_special
        self._ids: list[int] = []
        self._prefix = self._read = 0  # window start; end of the ids already emitted

    def _text(self, start: int, end: int) -> str:
        return self._tok.decode(self._ids[start:end], skip_special=self._skip)

    def push(self, token_id: int) -> str:
        self._tok._check_ids([token_id])
        self._ids.append(token_id)
        done, text = self._text(self._prefix, self._read), self._text(self._prefix, len(self._ids))
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""  # an incomplete character: wait for more bytes
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done):]

    def flush(self) -> str:
        done, text = self._text(self._prefix, self._read), self._text(self._prefix, len(self._ids))
        self._prefix = self._read = len(self._ids)
        return text[len(done):]

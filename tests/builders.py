"""Tiny models that the tests build themselves: random weights written to GGUF and to safetensors; and a drafter
that proposes random tokens."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFWriter, quants

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def byte_vocab() -> list[str]:
    """The 256 byte-level BPE symbols (GPT-2's printable spelling of each byte), then the specials."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    spelled = dict(zip(bs, map(chr, cs)))
    return [spelled[b] for b in range(256)] + SPECIALS


def random_raw(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random weights of `qtype` as the file stores them: uint8 [rows, row_bytes] (or float arrays)."""
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    if qtype == T.F32:
        return w
    if qtype == T.F16:
        return w.astype(np.float16)
    if qtype in (T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0):
        return quants.quantize(w, qtype)
    # K-quants: gguf has no quantizer; random bytes with small, sane fp16 super-block scales
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scales = (rng.uniform(0.0005, 0.002, (raw.shape[0], 2))).astype(np.float16).view(np.uint8)
    if qtype == T.Q4_K:
        raw[:, 0:4] = scales
    elif qtype == T.Q6_K:
        raw[:, 208:210] = scales[:, :2]
    return raw.reshape(rows, -1)


TINY = dict(n_layers=2, dim=256, ffn_dim=512, n_heads=4, n_kv_heads=2, vocab=len(byte_vocab()), ctx=256)


def write_tiny_gguf(path: Path, *, arch="llama", qtype=T.Q8_0, tied=True, seed=0, embd_qtype=None,
                    **meta_overrides) -> dict:
    """A tiny Llama/Qwen2 GGUF with every 2-D weight in `qtype` (the embedding in `embd_qtype` where given); returns
    {gguf name: (qtype, raw)}."""
    c, rng = TINY, np.random.default_rng(seed)
    hd = c["dim"] // c["n_heads"]
    w = GGUFWriter(str(path), arch)
    w.add_block_count(c["n_layers"])
    w.add_context_length(c["ctx"])
    w.add_embedding_length(c["dim"])
    w.add_feed_forward_length(c["ffn_dim"])
    w.add_head_count(c["n_heads"])
    w.add_head_count_kv(c["n_kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(c["vocab"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    vocab = byte_vocab()
    w.add_token_list(vocab)
    w.add_token_types([1] * 256 + [3] * len(SPECIALS))
    w.add_token_merges([])
    w.add_bos_token_id(vocab.index("<|endoftext|>"))
    w.add_eos_token_id(vocab.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for k, v in meta_overrides.items():
        w.add_string(k, v)
    tensors = {}

    def add(name, qt, rows, cols):
        raw = random_raw(qt, rows, cols, rng) if qt != T.F32 or rows > 1 else \
            (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
        tensors[name] = (qt, raw)
        if qt in (T.F32, T.F16):
            w.add_tensor(name, raw.reshape(cols) if rows == 1 else raw)
        else:
            w.add_tensor(name, raw, raw_dtype=qt)

    d, f, kv = c["dim"], c["ffn_dim"], c["n_kv_heads"] * hd
    add("token_embd.weight", embd_qtype or (qtype if qtype not in (T.Q4_K, T.Q6_K) else T.Q8_0), c["vocab"], d)
    add("output_norm.weight", T.F32, 1, d)
    if not tied:
        add("output.weight", qtype if qtype not in (T.Q4_K, T.Q6_K) else T.Q6_K, c["vocab"], d)
    for i in range(c["n_layers"]):
        add(f"blk.{i}.attn_norm.weight", T.F32, 1, d)
        add(f"blk.{i}.ffn_norm.weight", T.F32, 1, d)
        add(f"blk.{i}.attn_q.weight", qtype, d, d)
        add(f"blk.{i}.attn_k.weight", qtype, kv, d)
        add(f"blk.{i}.attn_v.weight", qtype, kv, d)
        add(f"blk.{i}.attn_output.weight", qtype, d, d)
        add(f"blk.{i}.ffn_gate.weight", qtype, f, d)
        add(f"blk.{i}.ffn_up.weight", qtype, f, d)
        add(f"blk.{i}.ffn_down.weight", qtype, d, f)
        if arch == "qwen2":
            for n, rows in (("q", d), ("k", kv), ("v", kv)):
                add(f"blk.{i}.attn_{n}.bias", T.F32, 1, rows)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def write_tiny_hf_folder(path: Path, *, dtype=torch.float32, arch="llama", seed=0) -> dict[str, torch.Tensor]:
    """A tiny Hugging Face folder: config.json, model.safetensors, tokenizer.json (+ chat template)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    c = TINY
    hd = c["dim"] // c["n_heads"]
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    d, f, kv = c["dim"], c["ffn_dim"], c["n_kv_heads"] * hd

    def rnd(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    sd = {"model.embed_tokens.weight": rnd(c["vocab"], d), "model.norm.weight": 1 + rnd(d, scale=0.1)}
    for i in range(c["n_layers"]):
        p = f"model.layers.{i}."
        sd.update({
            p + "input_layernorm.weight": 1 + rnd(d, scale=0.1),
            p + "post_attention_layernorm.weight": 1 + rnd(d, scale=0.1),
            p + "self_attn.q_proj.weight": rnd(d, d), p + "self_attn.k_proj.weight": rnd(kv, d),
            p + "self_attn.v_proj.weight": rnd(kv, d), p + "self_attn.o_proj.weight": rnd(d, d),
            p + "mlp.gate_proj.weight": rnd(f, d), p + "mlp.up_proj.weight": rnd(f, d),
            p + "mlp.down_proj.weight": rnd(d, f),
        })
        if arch == "qwen2":
            sd.update({p + "self_attn.q_proj.bias": rnd(d), p + "self_attn.k_proj.bias": rnd(kv),
                       p + "self_attn.v_proj.bias": rnd(kv)})
    save_file(sd, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"], "model_type": arch,
        "hidden_size": d, "intermediate_size": f, "num_hidden_layers": c["n_layers"],
        "num_attention_heads": c["n_heads"], "num_key_value_heads": c["n_kv_heads"], "vocab_size": c["vocab"],
        "max_position_embeddings": c["ctx"], "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": 256, "eos_token_id": 258,
    }
    (path / "config.json").write_text(json.dumps(config))
    vocab = {tok: i for i, tok in enumerate(byte_vocab())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}))
    return sd


class BadDrafter:
    """Proposes random tokens (and sometimes the right one): it must cost speed, never correctness."""
    name = "bad"

    def __init__(self, vocab, seed=0):
        self.rng, self.vocab = random.Random(seed), vocab

    def begin(self, prompt_ids):
        pass

    def propose(self, context, k, sampler=None):
        return [self.rng.randrange(self.vocab) for _ in range(k)]

    def end(self, context):
        pass

"""Load a model file into (config, named weights, tokenizer): GGUF files and Hugging Face safetensors folders.

Weights come back as `QTensor`s: the raw bytes of each tensor in its file type, under the model's own
parameter names (see model.py). Nothing is dequantized here; model building decides what to keep packed.
GGUF tensors are views of the file's mapping (the page cache: read on demand, never a second copy); what the kernels
stream every step is placed on huge pages by the model's transform (packed.py), and the rest stays in the file.
Every failure is a `ModelLoadError` naming the file and the problem.
"""

from __future__ import annotations

import json
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from . import gguf_file
from .config import ARCHITECTURES, ModelConfig
from .dequant import SUPPORTED, dequantize, row_bytes
from .tokenizer import Tokenizer, TokenizerError


class ModelLoadError(ValueError):
    pass


@dataclass
class QTensor:
    """One weight as stored in the file: `raw` is uint8 [rows, row_bytes] for 2-D tensors, `shape` the logical shape."""

    raw: torch.Tensor
    qtype: T
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.raw.numel() * self.raw.element_size()

    def dequantize(self) -> torch.Tensor:
        rows = int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1
        return dequantize(self.raw.reshape(rows, -1), self.qtype, self.shape[-1]).reshape(self.shape)

    def permute_rows(self, index: torch.Tensor) -> "QTensor":
        return QTensor(self.raw[index].contiguous(), self.qtype, self.shape)


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    tensors: dict[str, QTensor]
    tokenizer: Tokenizer
    mapping: np.memmap | None = None  # the GGUF file's mapping, which the tensors view (None: a safetensors folder)

    @property
    def file_tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def in_file(self, t: torch.Tensor) -> bool:
        """Whether `t` is a view of the file's mapping (page cache the kernel may drop and read again), not memory
        the process holds."""
        if self.mapping is None or t.numel() == 0:
            return False
        lo = self.mapping.ctypes.data
        return lo <= t.data_ptr() < lo + self.mapping.nbytes

    def release_file_pages(self, t: torch.Tensor | None = None) -> None:
        """Unmap the file's pages from this process (MADV_DONTNEED on its private mapping: nothing is written there, so
        a later read maps them again from the page cache or the file): all of them, or (t) those under tensor t, a
        view of the mapping (the pages it touches, whole). The model builders call it as they place what the kernels
        stream in memory of their own, a linear at a time, so the file's pages and the copies are not all mapped at
        once; the rare readers of the file's bytes (a draft head's rows, bf16 features, tensor-parallel slices)
        still read them."""
        mm = getattr(self.mapping, "_mmap", None)
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if mm is None or advice is None or not hasattr(mm, "madvise"):
            return
        try:
            if t is None:
                mm.madvise(advice)
            elif self.in_file(t):
                # the mmap object's start: numpy maps from the offset rounded down to the allocation granularity
                base = self.mapping.ctypes.data - self.mapping.offset % mmap.ALLOCATIONGRANULARITY
                lo = t.data_ptr() - base
                hi = lo + t.numel() * t.element_size()
                lo -= lo % mmap.PAGESIZE
                mm.madvise(advice, lo, min(hi, len(mm)) - lo)
        except (OSError, ValueError):
            pass


# GGUF tensor names -> the model's parameter names ({i} is the layer)
_GGUF_NAMES = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
    "blk.{i}.attn_norm.weight": "layers.{i}.attention_norm.weight",
    "blk.{i}.attn_q.weight": "layers.{i}.attention.wq.weight",
    "blk.{i}.attn_k.weight": "layers.{i}.attention.wk.weight",
    "blk.{i}.attn_v.weight": "layers.{i}.attention.wv.weight",
    "blk.{i}.attn_q.bias": "layers.{i}.attention.wq.bias",
    "blk.{i}.attn_k.bias": "layers.{i}.attention.wk.bias",
    "blk.{i}.attn_v.bias": "layers.{i}.attention.wv.bias",
    "blk.{i}.attn_output.weight": "layers.{i}.attention.wo.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.ffn_norm.weight",
    "blk.{i}.ffn_gate.weight": "layers.{i}.feed_forward.w1.weight",
    "blk.{i}.ffn_up.weight": "layers.{i}.feed_forward.w3.weight",
    "blk.{i}.ffn_down.weight": "layers.{i}.feed_forward.w2.weight",
}
# Hugging Face safetensors names -> the model's parameter names
_HF_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attention_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attention.wq.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attention.wk.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attention.wv.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "layers.{i}.attention.wq.bias",
    "model.layers.{i}.self_attn.k_proj.bias": "layers.{i}.attention.wk.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "layers.{i}.attention.wv.bias",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attention.wo.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.feed_forward.w1.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.feed_forward.w3.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.feed_forward.w2.weight",
}


def _name_table(table: dict[str, str], n_layers: int) -> dict[str, str]:
    out = {}
    for src, dst in table.items():
        if "{i}" in src:
            for i in range(n_layers):
                out[src.format(i=i)] = dst.format(i=i)
        else:
            out[src] = dst
    return out


def _unpermute_rows(n_rows: int, n_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation (interleaved RoPE pairs -> rotate-half halves)."""
    head_dim = n_rows // n_heads
    return torch.arange(n_rows).reshape(n_heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)


def _required(meta: dict, key: str, path: Path):
    if key not in meta:
        raise ModelLoadError(f"{path}: missing metadata key {key!r}")
    return meta[key]


def _check_tensors(tensors: dict[str, QTensor], config: ModelConfig, path: Path) -> None:
    d, hd, L = config.dim, config.head_dim, config.n_layers
    expect = {"tok_embeddings.weight": (config.vocab_size, d), "norm.weight": (d,)}
    if not config.tie_embeddings:
        expect["output.weight"] = (config.vocab_size, d)
    for i in range(L):
        p = f"layers.{i}."
        expect.update({
            p + "attention_norm.weight": (d,), p + "ffn_norm.weight": (d,),
            p + "attention.wq.weight": (config.n_heads * hd, d),
            p + "attention.wk.weight": (config.n_kv_heads * hd, d),
            p + "attention.wv.weight": (config.n_kv_heads * hd, d),
            p + "attention.wo.weight": (d, config.n_heads * hd),
            p + "feed_forward.w1.weight": (config.ffn_dim, d),
            p + "feed_forward.w3.weight": (config.ffn_dim, d),
            p + "feed_forward.w2.weight": (d, config.ffn_dim),
        })
        if config.qkv_bias:
            expect.update({p + "attention.wq.bias": (config.n_heads * hd,),
                           p + "attention.wk.bias": (config.n_kv_heads * hd,),
                           p + "attention.wv.bias": (config.n_kv_heads * hd,)})
    for name, shape in expect.items():
        if name not in tensors:
            raise ModelLoadError(f"{path}: missing tensor {name}")
        if tuple(tensors[name].shape) != shape:
            raise ModelLoadError(f"{path}: tensor {name} has shape {tensors[name].shape}, expected {shape}")


# ---------------------------------------------------------------- GGUF

def read_gguf(path: Path):
    try:
        return gguf_file.read(path)
    except gguf_file.GGUFFormatError as e:
        raise ModelLoadError(f"{path}: corrupt GGUF file: {e}") from None


def load_gguf(path: Path) -> LoadedModel:
    meta, infos, data = read_gguf(path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")

    def get(key, default=None):
        full = f"{arch}.{key}"
        if default is None:
            return _required(meta, full, path)
        return meta.get(full, default)

    try:
        tokenizer = Tokenizer.from_gguf_metadata(meta, str(path))
    except TokenizerError as e:
        raise ModelLoadError(str(e)) from None
    names = {t.name for t in infos}
    try:  # metadata of the wrong type or out of range (a count that is a string, NaN, 0 heads) is refused here
        n_heads, dim = int(get("attention.head_count")), int(get("embedding_length"))
        if n_heads <= 0:
            raise ValueError(f"attention.head_count must be positive, got {n_heads}")
        config = ModelConfig(
            arch=arch,
            n_layers=int(get("block_count")),
            dim=dim,
            ffn_dim=int(get("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(get("attention.head_count_kv", n_heads)),
            head_dim=int(get("attention.key_length", 0) or get("rope.dimension_count", 0) or dim // n_heads),
            vocab_size=int(get("vocab_size", 0) or len(meta.get("tokenizer.ggml.tokens", []))),
            context_length=int(get("context_length")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            qkv_bias="blk.0.attn_q.bias" in names,
            tie_embeddings="output.weight" not in names,
        )
    except (ValueError, TypeError, OverflowError) as e:
        raise ModelLoadError(f"{path}: bad model metadata: {e}") from None
    layers = {int(n.split(".")[1]) for n in names if n.startswith("blk.") and n.split(".")[1].isdigit()}
    if config.n_layers != len(layers) or (layers and max(layers) != config.n_layers - 1):
        raise ModelLoadError(f"{path}: block_count is {config.n_layers} but the file has tensors of "
                             f"{len(layers)} layers")

    table = _name_table(_GGUF_NAMES, config.n_layers)
    tensors: dict[str, QTensor] = {}
    for t in infos:
        if t.name not in table:
            if t.name == "rope_freqs.weight":
                raise ModelLoadError(f"{path}: RoPE frequency scaling (rope_freqs) is not supported yet")
            continue
        if t.qtype not in set(SUPPORTED):
            kind = T(t.qtype).name if t.qtype in T._value2member_map_ else f"#{t.qtype}"
            raise ModelLoadError(f"{path}: tensor {t.name} has unsupported type {kind}")
        qtype = T(t.qtype)
        if not t.shape or any(d <= 0 for d in t.shape):
            raise ModelLoadError(f"{path}: tensor {t.name} has shape {list(t.shape)} (an empty dimension)")
        shape = tuple(reversed(t.shape))  # GGUF lists the fastest dimension first
        cols, rows = shape[-1], int(np.prod(shape[:-1]))
        try:
            nbytes = rows * row_bytes(qtype, cols)
        except ValueError as e:
            raise ModelLoadError(f"{path}: tensor {t.name}: {e}") from None
        if t.offset + nbytes > len(data):
            raise ModelLoadError(f"{path}: tensor {t.name} runs past the end of the file (truncated?)")
        raw = torch.from_numpy(data[t.offset:t.offset + nbytes].reshape(rows, -1))  # a view until the end
        tensors[table[t.name]] = QTensor(raw, qtype, shape)

    _check_tensors(tensors, config, path)  # every shape as the config says, before anything relies on it
    if config.arch == "llama":  # llama.cpp stores Q and K rows permuted for its interleaved RoPE
        for i in range(config.n_layers):
            for key, heads in (("wq", config.n_heads), ("wk", config.n_kv_heads)):
                for kind in ("weight", "bias"):
                    name = f"layers.{i}.attention.{key}.{kind}"
                    if name in tensors:
                        idx = _unpermute_rows(tensors[name].shape[0], heads)
                        tensors[name] = tensors[name].permute_rows(idx)
    return LoadedModel(Path(path), config, tensors, tokenizer, data)


# ---------------------------------------------------------------- safetensors

_TORCH_TO_GGML = {torch.float32: T.F32, torch.float16: T.F16, torch.bfloat16: T.BF16}


def load_hf_folder(path: Path) -> LoadedModel:
    from safetensors import safe_open

    cfg_path = path / "config.json"
    try:
        hf = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: cannot read model config ({e})") from None
    model_type = hf.get("model_type")
    arch = {"llama": "llama", "qwen2": "qwen2"}.get(model_type)
    if arch is None:
        raise ModelLoadError(f"{cfg_path}: unsupported model_type {model_type!r} (supported: llama, qwen2)")
    if hf.get("rope_scaling"):
        raise ModelLoadError(f"{cfg_path}: rope_scaling is not supported yet")
    n_heads = int(hf["num_attention_heads"])
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    try:
        tokenizer = Tokenizer.from_hf_dir(path)
    except TokenizerError as e:
        raise ModelLoadError(str(e)) from None
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    raw[k] = sf.get_tensor(k)
        except Exception as e:
            raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from None
    try:
        config = ModelConfig(
            arch=arch,
            n_layers=int(hf["num_hidden_layers"]),
            dim=int(hf["hidden_size"]),
            ffn_dim=int(hf["intermediate_size"]),
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads", n_heads)),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // n_heads),
            vocab_size=int(hf["vocab_size"]),
            context_length=int(hf.get("max_position_embeddings", 4096)),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            tie_embeddings="lm_head.weight" not in raw,
        )
    except (KeyError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{cfg_path}: bad model config ({e})") from None
    table = _name_table(_HF_NAMES, config.n_layers)
    tensors = {}
    for k, v in raw.items():
        if k not in table:
            continue
        if v.dtype not in _TORCH_TO_GGML:
            raise ModelLoadError(f"{path}: tensor {k} has unsupported dtype {v.dtype}")
        shape = tuple(v.shape)
        flat = v.contiguous().reshape(-1, shape[-1]) if v.dim() > 1 else v.contiguous().reshape(1, -1)
        tensors[table[k]] = QTensor(flat.view(torch.uint8), _TORCH_TO_GGML[v.dtype], shape)
    _check_tensors(tensors, config, path)
    return LoadedModel(path, config, tensors, tokenizer)


def load(path: str | Path) -> LoadedModel:
    """Load a GGUF file or a Hugging Face folder (config.json + *.safetensors + tokenizer.json).

    The format is decided by the file's contents (the GGUF magic) and the folder's layout, never by its name.
    """
    path = Path(path)
    if path.is_dir():
        return load_hf_folder(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file or folder")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (magic {magic!r}) nor a model folder")
    return load_gguf(path)

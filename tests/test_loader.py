"""Loading: tiny models built here for every tensor type, and the error paths."""

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, quants

from tests.builders import TINY, write_tiny_gguf, write_tiny_hf_folder
from ultrafast.dequant import dequantize, row_bytes
from ultrafast.engine import ContextOverflowError, Engine
from ultrafast.loader import ModelLoadError, _unpermute_rows, load
from ultrafast.model import build_model
from ultrafast.sampler import SamplingParams

TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q4_K, T.Q6_K]


def reference(qt, raw):
    if qt in (T.F32, T.F16):
        return torch.from_numpy(np.asarray(raw, dtype=np.float32))
    return torch.from_numpy(quants.dequantize(raw, qt).astype(np.float32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference(qtype):
    from tests.builders import random_raw

    raw = random_raw(qtype, 8, 512, np.random.default_rng(1))
    ours = dequantize(torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8).reshape(8, -1), qtype, 512)
    assert torch.equal(ours, reference(qtype, raw))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_weights_load_as_the_reference_dequantization(tmp_path, qtype, arch):
    path = tmp_path / "tiny.gguf"
    written = write_tiny_gguf(path, arch=arch, qtype=qtype, tied=(qtype != T.Q4_0))
    loaded = load(path)
    c = loaded.config
    assert (c.arch, c.n_layers, c.dim, c.n_heads, c.n_kv_heads) == (arch, 2, TINY["dim"], 4, 2)
    assert c.qkv_bias == (arch == "qwen2") and c.tie_embeddings == (qtype != T.Q4_0)
    model = build_model(loaded)
    params = dict(model.named_parameters())
    q_rows = _unpermute_rows(c.n_heads * c.head_dim, c.n_heads)
    for i in range(c.n_layers):
        qt, raw = written[f"blk.{i}.attn_q.weight"]
        want = reference(qt, raw)
        if arch == "llama":  # llama.cpp's permuted Q rows come back in Hugging Face's order
            want = want[q_rows]
        assert torch.equal(params[f"layers.{i}.attention.wq.weight"], want)
        qt, raw = written[f"blk.{i}.ffn_down.weight"]
        assert torch.equal(params[f"layers.{i}.feed_forward.w2.weight"], reference(qt, raw))
        qt, raw = written[f"blk.{i}.attn_norm.weight"]
        assert torch.equal(params[f"layers.{i}.attention_norm.weight"], reference(qt, raw))
    qt, raw = written["token_embd.weight"]
    emb = reference(qt, raw)
    assert torch.equal(model.tok_embeddings(torch.tensor([3, 100, 257])), emb[[3, 100, 257]])
    head = written.get("output.weight")
    assert torch.equal(params["output.weight"], emb if head is None else reference(*head))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_safetensors_folder_matches_transformers(tmp_path, dtype, arch):
    from transformers import AutoModelForCausalLM

    sd = write_tiny_hf_folder(tmp_path, dtype=dtype, arch=arch)
    loaded = load(tmp_path)
    model = build_model(loaded)
    assert torch.equal(dict(model.named_parameters())["layers.1.feed_forward.w3.weight"],
                       sd["model.layers.1.mlp.up_proj.weight"].float())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.tensor([5, 17, 99, 256, 3, 200, 42])
    engine = Engine(loaded, model, max_context=64)
    ours = engine.forward(ids.tolist(), 0, all_logits=True)
    with torch.no_grad():
        ref = hf(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits[0]
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    data = path.read_bytes()
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 200)
    with pytest.raises(ModelLoadError, match="garbage.gguf"):
        load(bad)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated.gguf"):
        load(truncated)
    notgguf = tmp_path / "weights.gguf"
    notgguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load(notgguf)
    with pytest.raises(ModelLoadError, match="no such file"):
        load(tmp_path / "missing.gguf")


def test_unknown_architecture_is_a_clear_error(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_tiny_gguf(path, arch="mamba")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'"):
        load(path)
    folder = tmp_path / "hf"
    write_tiny_hf_folder(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt_neox'"):
        load(folder)


def test_prompt_longer_than_the_context_is_a_clear_error(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    engine = Engine.from_path(path, max_context=32, device="cpu")
    with pytest.raises(ContextOverflowError, match="does not fit the context of 32"):
        engine.generate(list(range(40)), SamplingParams(max_tokens=4))
    # a prompt that fits still generates, and stops at the context's end with finish_reason "length"
    res = engine.generate(list(range(30)), SamplingParams(max_tokens=10, ignore_eos=True))
    assert res.completion_tokens == 2 and res.finish_reason == "length"


def test_row_bytes_rejects_partial_blocks():
    assert row_bytes(T.Q4_K, 512) == 288
    with pytest.raises(ValueError, match="multiple of 256"):
        row_bytes(T.Q4_K, 300)

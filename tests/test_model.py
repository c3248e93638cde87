"""The plain PyTorch model (model.py): its attention core."""

import torch

from ultrafast.model import AttentionCore


def test_attention_from_position_0_is_the_causal_masked_softmax():
    """From a sequence's start the core takes PyTorch's fused causal path; it is the masked softmax, grouped-query."""
    g = torch.Generator().manual_seed(0)
    T, H, Hkv, D = 7, 4, 2, 16
    q = torch.randn(T, H, D, generator=g)
    k_cache, v_cache = torch.randn(Hkv, 12, D, generator=g), torch.randn(Hkv, 12, D, generator=g)
    got = AttentionCore()(q, k_cache, v_cache, 0, 0.25)
    k = k_cache[:, :T].repeat_interleave(H // Hkv, dim=0)
    v = v_cache[:, :T].repeat_interleave(H // Hkv, dim=0)
    s = (q.transpose(0, 1) @ k.transpose(1, 2)) * 0.25
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    want = (s.softmax(-1) @ v).transpose(0, 1)
    assert got.shape == (T, H, D) and torch.allclose(got, want, atol=1e-5)
    # the same rows computed after the first one (the masked path, start_pos 1) agree
    rest = AttentionCore()(q[1:], k_cache, v_cache, 1, 0.25)
    assert torch.allclose(rest, want[1:], atol=1e-5)


def test_hidden_layers_come_after_the_last_layers_output(smollm_engine):
    """hidden=(i, j): each row holds the last layer's output, then layer i's and layer j's (EAGLE-3's features),
    each bit-identical to a forward that stops after that layer; the logits do not change."""
    e = smollm_engine
    ids = e.tokenizer.encode("def add(a, b):\n    return a + b\n")
    D = e.config.dim
    logits, last = e.forward(ids, 0, cache=e.new_cache(), hidden=True)
    logits2, h = e.forward(ids, 0, cache=e.new_cache(), hidden=(2, 15))
    assert h.shape == (len(ids), 3 * D)
    assert torch.equal(logits, logits2) and torch.equal(h[:, :D], last)
    for part, i in ((1, 2), (2, 15)):
        _, upto = e.forward(ids, 0, cache=e.new_cache(), layers=list(range(i + 1)), hidden=True)
        assert torch.equal(h[:, part * D:(part + 1) * D], upto)

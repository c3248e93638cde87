"""Token trees verified in one forward: every node's logits are the bits of feeding its path one token at a
time, and the accepted path's KV rows end where plain decoding writes them (the batch-invariance property,
extended to trees), on every kernel path and on the real model."""

import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.builders import write_tiny_gguf
from tests.kernels.test_qmatmul import path  # noqa: F401  (the kernel-path fixture: vnni, avx512 fp32, scalar)
from ultrafast.engine import Engine
from ultrafast.token_tree import TreeLayout, keep_path

# root 0; 1, 2, 3 below it; 4, 5 below 1; 6 below 4; 7 below 2; 8 below 6 (depths 1-4, branching 3)
PARENTS = [-1, 0, 0, 0, 1, 1, 4, 2, 6]


def copy_cache(engine, cache):
    c = engine.new_cache()
    c.k.copy_(cache.k)
    c.v.copy_(cache.v)
    return c


def check_tree(engine, prefix: list[int], root: int, node_tokens: list[int], parents=PARENTS, exact=True):
    pos = len(prefix)
    base = engine.new_cache()
    engine.forward(prefix, 0, cache=base)
    tree = TreeLayout(parents, pos)
    cache = copy_cache(engine, base)
    logits, hidden = engine.forward([root] + node_tokens, pos, all_logits=True, cache=cache, tree=tree, hidden=True)
    toks = [root] + node_tokens
    for j in range(len(parents)):
        path = tree.ancestors(j)
        seq = copy_cache(engine, base)
        out = engine.forward([root], pos, all_logits=True, cache=seq, hidden=True)
        for i, node in enumerate(path, start=1):
            out = engine.forward([toks[node]], pos + i, all_logits=True, cache=seq, hidden=True)
        if exact:
            assert torch.equal(logits[j], out[0][0]), f"node {j}: max diff {(logits[j] - out[0][0]).abs().max()}"
            assert torch.equal(hidden[j], out[1][0])
        else:
            assert torch.allclose(logits[j], out[0][0], atol=2e-4, rtol=2e-4)
        if j == len(parents) - 1:  # the deepest path: keep it, and its rows are the sequential ones
            keep_path(cache, pos, path)
            end = pos + len(path) + 1
            if exact:
                assert torch.equal(cache.k[:, :, :end], seq.k[:, :, :end])
                assert torch.equal(cache.v[:, :, :end], seq.v[:, :, :end])
            else:
                assert torch.allclose(cache.k[:, :, :end], seq.k[:, :, :end], atol=1e-5)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_tree_nodes_equal_their_paths_fed_one_at_a_time(tmp_path, path, qtype):  # noqa: F811
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, arch="qwen2", qtype=qtype, tied=True)
    for prefix_len in (1, 21, 40):
        engine = Engine.from_path(gguf, max_context=128, packed=True)
        check_tree(engine, list(range(3, 3 + prefix_len)), 50, [60, 61, 62, 63, 64, 65, 66, 67])


def test_the_per_op_kernels_and_the_reference_take_trees_too(tmp_path):
    from functools import partial

    from ultrafast.loader import load
    from ultrafast.model import build_model
    from ultrafast.packed import apply_packed

    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, arch="llama", qtype=T.Q8_0, tied=False)
    loaded = load(gguf)
    per_op = Engine(loaded, build_model(loaded, "cpu", partial(apply_packed, fuse=False)), max_context=128)
    assert per_op.kernels_in_use().startswith("packed, per-op")
    check_tree(per_op, list(range(3, 30)), 50, [60, 61, 62, 63, 64, 65, 66, 67])
    ref = Engine.from_path(gguf, max_context=128, packed=False)
    check_tree(ref, list(range(3, 30)), 50, [60, 61, 62, 63, 64, 65, 66, 67], exact=False)


def test_smollm2_tree_is_exact(smollm_engine):
    ids = smollm_engine.raw_prompt("The three largest cities of France are")
    check_tree(smollm_engine, ids[:-1], ids[-1], [264, 12231, 30, 28, 1066, 314, 4010, 28])


def test_a_chain_layout_is_the_causal_one():
    tree = TreeLayout([-1, 0, 1, 2], 10)
    keys, extra = tree.kernel_args
    assert tree.is_chain() and keys.tolist() == [[11, 0], [11, 1], [11, 2], [11, 3]]
    assert extra.tolist() == [11, 11, 12, 11, 12, 13]
    assert tree.positions().tolist() == [10, 11, 12, 13]
    causal = torch.arange(14)[None, :] <= torch.arange(10, 14)[:, None]
    assert torch.equal(tree.mask, causal)


@pytest.mark.parametrize("parents", [[0, -1], [-1, 1], [-1, 0, 3, 1], []])
def test_bad_trees_are_refused(parents):
    with pytest.raises(ValueError):
        TreeLayout(parents, 5)


def test_the_kernel_refuses_bad_key_lists(smollm_engine):
    e = smollm_engine
    bad = TreeLayout([-1, 0], e.max_context - 1)  # a slot past the cache
    with pytest.raises((ValueError, RuntimeError)):
        e.forward([1, 2], e.max_context - 1, all_logits=True, cache=e.new_cache(), tree=bad)


def test_a_lookup_chain_grafts_onto_a_ranked_tree():
    """Tree: root -> 5 (score -0.1) -> 6 (-0.5); root -> 7 (-1.0). A chain 5, 8, 9 at log 0.5 per token runs
    along node 5 and then leaves it: the result is ranked, every parent before its children, and the chain's
    path is in it."""
    from ultrafast.token_tree import graft

    toks, parents, scores = graft([5, 6, 7], [0, 1, 0], [-0.1, -0.5, -1.0], [5, 8, 9], -0.693)
    assert len(toks) == 5 and sorted(toks) == [5, 6, 7, 8, 9]
    assert all(0 <= p < i for i, p in enumerate(parents, start=1))
    assert scores == sorted(scores, reverse=True)
    by_tok = {t: i for i, t in enumerate(toks, start=1)}
    assert parents[by_tok[8] - 1] == by_tok[5] and parents[by_tok[9] - 1] == by_tok[8]
    assert scores[by_tok[5] - 1] == -0.1  # already likelier than the chain's first step
    TreeLayout([-1] + parents, 3)  # a valid layout

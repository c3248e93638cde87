"""The draft head's drafter: the same network as in training, and the ultrafast tier exact with it."""

import pytest
import torch

from ultrafast.draft_head import file_sha256, load_head
from ultrafast.drafters.head import HeadDrafter
from ultrafast.sampler import SamplingParams
from ultrafast.training.features import sequence_features
from ultrafast.training.trainer import chain_passes


def test_drafting_runs_the_network_training_ran(tiny_head, smollm_engine, smollm_path):
    """The drafter's rows (fed the target's features through `observe`, as the stepper feeds them) predict the
    features that training's passes predict for the same positions, at depth 1 and, fed its own prediction
    and the next token, at depth 2."""
    e = smollm_engine
    head = load_head(tiny_head[1], e.model, file_sha256(smollm_path), pack=False)
    ids = e.chat_prompt([{"role": "user", "content": "Name three rivers of Europe and their lengths."}])
    feats, _ = sequence_features(e, ids, e.new_cache())
    feats = feats.float()
    emb = e.model.tok_embeddings(torch.tensor(ids)).float()
    passes = chain_passes(head, emb, feats, 2)
    (pos1, pred1), (pos2, pred2) = passes
    p = len(ids) - 3
    d = HeadDrafter(e, head, 0.05, 512)
    d.observe(0, feats[:p], ids[1:p + 1])  # rows for positions 1..p
    d._flush()
    assert d.upto == p + 1
    assert torch.allclose(d.f_last[0], pred1[pos1 == p][0], atol=1e-3, rtol=1e-3)
    nxt = d._rows(p + 1, [ids[p + 1]], d.f_last)  # depth 2: its own feature and the next token
    assert torch.allclose(nxt[0], pred2[pos2 == p + 1][0], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=48),
                                    SamplingParams(max_tokens=48, temperature=0.9, top_p=0.95, seed=11)],
                         ids=["greedy", "sampled"])
def test_the_ultrafast_tier_with_the_head_is_the_standard_tier(tiny_head, smollm_path, params):
    """Every pass drafts 3 tokens with the head (no policy): outputs equal the standard tier's, drafts were
    both kept and rejected; then again on a cache that reuses the prompt's rows (the head starts mid-prompt)."""
    from ultrafast.engine import Engine

    e = Engine.from_path(smollm_path, max_context=1024)
    e.attach_draft_head(tiny_head[1])
    e.fixed_draft_k = 3
    prompts = [e.chat_prompt([{"role": "user", "content": q}]) for q in
               ("What does the Python module `json` do?", "Write a haiku about the sea.")]
    kept = rejected = 0
    for ids in prompts:
        std = e.generate(ids, params)
        cache = e.new_cache()
        for _ in range(2):  # the second run reuses the prompt's KV rows
            fast = e.generate(ids, params, tier="ultrafast", drafters=["head"], cache=cache)
            assert fast.token_ids == std.token_ids
            st = fast.spec["drafters"]["head"]
            kept += st["accepted"]
            rejected += st["drafted"] - st["accepted"]
        assert fast.cached_tokens > 0
    assert kept > 0 and rejected > 0


@pytest.mark.parametrize("path", ["auto", "avx2"])
def test_the_head_drafts_with_8_bit_activations(tiny_head, smollm_path, path):
    """With 8-bit activations the head's packed linears (Q8_0) and its rows of the target's LM head run on the same
    integer kernels as the target (VNNI, or AVX2's where VNNI is absent or the AVX2 path is asked for): the tier
    stays the standard tier."""
    from ultrafast import kernels
    from ultrafast.engine import Engine

    if path == "avx2" and not kernels.load().avx2_supported():
        pytest.skip("CPU without AVX2")
    kernels.set_kernels_path(path)
    try:
        if not kernels.linear_path(kernels.Q8_0, 8):
            pytest.skip("no integer kernels for 8-bit activations on this CPU")
        e = Engine.from_path(smollm_path, max_context=1024, activation_bits=8)
        e.attach_draft_head(tiny_head[1])
        e.fixed_draft_k = 3
        ids = e.chat_prompt([{"role": "user", "content": "What does the Python module `json` do?"}])
        params = SamplingParams(max_tokens=40)
        std = e.generate(ids, params)
        fast = e.generate(ids, params, tier="ultrafast", drafters=["head"])
        assert fast.token_ids == std.token_ids
        assert fast.spec["drafters"]["head"]["drafted"] > 0
    finally:
        kernels.set_kernels_path("auto")


def test_a_request_starts_from_the_heads_own_held_out_figure(tiny_head, smollm_engine, smollm_path):
    """The policy's first estimate of what a tree gets accepted is the head's report (chain tau less one), not
    a fixed optimism: a weak head is left to its probes from the first token."""
    from ultrafast.speculative import SpeculativeStepper

    report, path = tiny_head
    head = load_head(path, smollm_engine.model, file_sha256(smollm_path))
    d = HeadDrafter(smollm_engine, head, 0.05, 256)
    assert d.expected_accepted == pytest.approx(report["heldout"]["tau_by_chain_length"][-1] - 1.0)
    st = SpeculativeStepper(smollm_engine, smollm_engine.new_cache(), [d], [0.0] + [1.0 + 0.2 * k for k in range(17)])
    assert st.stats.by_drafter["head"].tree_accepted == d.expected_accepted


@pytest.fixture(scope="module")
def fused_head(smollm_path, tmp_path_factory):
    """A tiny head that also reads two lower layers' outputs (EAGLE-3's fused features): (report, path)."""
    import io

    from tests.conftest import docstring_conversations
    from ultrafast.training import Recipe, train_draft

    d = tmp_path_factory.mktemp("fused-head")
    recipe = Recipe(tokens=4000, seq_len=192, epochs=3, depth=2, lr=2e-3, batch_tokens=384, draft_vocab=2048,
                    code_share=0.3, heldout=6, extra_layers="12,3")
    report = train_draft(str(smollm_path), recipe, out=d / "head.pt", work_dir=d / "work", stream=io.StringIO(),
                         conversations=docstring_conversations())
    return report, d / "head.pt"


def test_a_head_on_fused_features_trains_drafts_as_trained_and_stays_exact(fused_head, smollm_engine, smollm_path):
    """extra_layers: the head reads the target's last layer and layers 3 and 12 (sorted), learns, drafts from
    the same rows training computed, the stepper asks the target's forward for those layers, and the ultrafast
    tier still emits the standard tier's tokens."""
    from ultrafast.engine import Engine

    report, path = fused_head
    assert report["heldout"]["acceptance_by_depth"][0] > report["heldout_untrained"]["acceptance_by_depth"][0] + 0.1
    e = smollm_engine
    head = load_head(path, e.model, file_sha256(smollm_path), pack=False)
    assert head.config.extra_layers == (3, 12) and head.config.feature_dim == 3 * e.config.dim
    ids = e.chat_prompt([{"role": "user", "content": "Name three rivers of Europe and their lengths."}])
    feats, _ = sequence_features(e, ids, e.new_cache(), layers=(3, 12))
    feats = feats.float()
    (pos1, pred1), (pos2, pred2) = chain_passes(head, e.model.tok_embeddings(torch.tensor(ids)).float(), feats, 2)
    p = len(ids) - 3
    d = HeadDrafter(e, head, 0.05, 512)
    assert d.wants_hidden == (3, 12)
    d.observe(0, feats[:p], ids[1:p + 1])
    d._flush()
    assert torch.allclose(d.f_last[0], pred1[pos1 == p][0], atol=1e-3, rtol=1e-3)
    nxt = d._rows(p + 1, [ids[p + 1]], d.f_last)  # depth 2: its own (last-layer) prediction fed back
    assert torch.allclose(nxt[0], pred2[pos2 == p + 1][0], atol=1e-3, rtol=1e-3)

    fast_e = Engine.from_path(smollm_path, max_context=1024)
    fast_e.attach_draft_head(path)
    fast_e.fixed_draft_k = 3
    params = SamplingParams(max_tokens=40)
    std = fast_e.generate(ids, params)
    fast = fast_e.generate(ids, params, tier="ultrafast", drafters=["head"])
    assert fast.token_ids == std.token_ids and fast.spec["drafters"]["head"]["drafted"] > 0


def test_the_heads_costs_are_measured_on_first_use(tiny_head, smollm_path):
    """A draft token's cost and the upkeep of the head's cache per kept row, each in target steps, are measured
    when an ultrafast stepper first asks for the head, and forgotten when another head is attached."""
    import math

    from ultrafast.engine import Engine

    e = Engine.from_path(smollm_path, max_context=512)
    e.attach_draft_head(tiny_head[1])
    assert e.head_cost is None and e.head_upkeep is None
    e.stepper("ultrafast", drafters=["head"])
    for v in (e.head_cost, e.head_upkeep):
        assert isinstance(v, float) and math.isfinite(v) and v >= 0.0
    assert e.head_cost > 0.0
    e.attach_draft_head(tiny_head[1])
    assert e.head_cost is None and e.head_upkeep is None

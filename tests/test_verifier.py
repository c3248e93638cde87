"""Verification keeps exactly the target's tokens: greedy, and sampled with a seed whatever was drafted."""

import pytest
import torch

from tests.builders import write_tiny_gguf
from ultrafast.engine import Engine
from ultrafast.sampler import Sampler, SamplingParams
from ultrafast.verifier import verify, verify_tree

# target p and draft q at three draft positions and the bonus position, over 6 tokens; q puts mass where p has
# none (token 5) and misses tokens p wants (token 0 at position 1)
P = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.10, 0.00],
                  [0.30, 0.30, 0.20, 0.10, 0.10, 0.00],
                  [0.05, 0.05, 0.10, 0.20, 0.60, 0.00],
                  [0.20, 0.20, 0.20, 0.20, 0.20, 0.00]], dtype=torch.float64)
Q = torch.tensor([[0.10, 0.10, 0.20, 0.20, 0.20, 0.20],
                  [0.00, 0.50, 0.30, 0.10, 0.05, 0.05],
                  [0.05, 0.05, 0.10, 0.20, 0.60, 0.00]], dtype=torch.float64)


def _logits(p):
    return torch.log(p).float()  # -inf where p = 0: softmax gives p back


def _drafts(sampler, dist):
    """3 drafts, each the sampler's choice from a row of dist at the position it drafts for."""
    drafts = []
    for j in range(3):
        drafts.append(sampler.draft(_logits(dist[j]), [0] + drafts, j))
    return drafts


def test_walk_is_greedy_prefix_plus_bonus():
    logits = torch.zeros(4, 6)
    for j, t in enumerate([3, 1, 4, 2]):
        logits[j, t] = 1.0
    assert verify(logits, [3, 1, 5], Sampler(SamplingParams(), [])) == [3, 1, 4]
    assert verify(logits, [3, 1, 4], Sampler(SamplingParams(), [])) == [3, 1, 4, 2]
    with pytest.raises(ValueError, match="rows of logits"):
        verify(logits, [3, 1], Sampler(SamplingParams(), []))


def test_tree_walk_follows_the_child_the_target_samples():
    """Root's argmax 3 -> node 2 (token 3, beside node 1 holding 5); node 2's argmax 1 -> node 4; node 4's
    argmax 2 is no child's: emitted 3, 1, 2; accepted nodes 2, 4. The chain rule is the tree rule."""
    tokens, parents = [5, 3, 1, 1, 9], [0, 0, 1, 2, 2]
    logits = torch.zeros(6, 10)
    for row, t in enumerate([3, 0, 1, 0, 2, 0]):
        logits[row, t] = 1.0
    out, path = verify_tree(logits, tokens, parents, Sampler(SamplingParams(), []))
    assert out == [3, 1, 2] and path == [2, 4]
    with pytest.raises(ValueError, match="must come before"):
        verify_tree(logits, tokens, [0, 0, 3, 2, 2], Sampler(SamplingParams(), []))
    with pytest.raises(ValueError, match="rows of logits"):
        verify_tree(logits[:5], tokens, parents, Sampler(SamplingParams(), []))


def test_sampled_tree_walk_emits_the_standard_samples():
    """With a seed, the tokens a tree walk emits are the sampler's own draws in order, whatever the tree."""
    torch.manual_seed(0)
    logits = torch.randn(7, 12)
    params = SamplingParams(temperature=1.0, seed=5)
    plain = Sampler(params, [1])
    want = [plain.sample(logits[0])]
    s = Sampler(params, [1])
    first = want[0]
    tokens, parents = [first, (first + 1) % 12, 4, 5, 6, 7], [0, 0, 1, 1, 3, 3]
    out, path = verify_tree(logits, tokens, parents, s)
    assert out[0] == want[0] and path[0] == 1
    ref = Sampler(params, [1])  # replay: each emitted token is the draw at its node's logits
    nodes = [0] + path
    assert out == [ref.sample(logits[n]) for n in nodes[:len(out)]]


def test_peeking_leaves_the_stream_unchanged():
    """A drafter peeking at uniforms ahead changes no sample: the stream is one uniform per emitted token."""
    rows = _logits(P)
    plain, peeked = Sampler(SamplingParams(temperature=1.0, seed=11), [0]), Sampler(SamplingParams(temperature=1.0, seed=11), [0])
    a, b = [], []
    for i in range(40):
        a.append(plain.sample(rows[i % 4]))
        peeked.uniform(i % 5)  # up to 4 positions ahead, as a drafter drafting 5 would
        b.append(peeked.sample(rows[i % 4]))
    assert a == b and len(set(a)) > 2


def test_a_draft_from_the_targets_own_distribution_is_always_kept():
    """Drafting from p itself picks, at every position, the very token the target samples there."""
    for seed in range(200):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed), [0])
        drafts = _drafts(sampler, P)
        out = verify(_logits(P), drafts, sampler)
        assert out[:3] == drafts and len(out) == 4 and out == sampler.history[1:]


def test_sampled_drafts_change_no_token():
    """Drafts from q != p: kept sometimes, rejected sometimes, and the emitted tokens are always those a
    sampler with the same seed emits with no drafts at all."""
    accepted = rejected = 0
    for seed in range(2000):
        params = SamplingParams(temperature=1.0, seed=seed)
        sampler = Sampler(params, [0])
        drafts = _drafts(sampler, Q)
        out = verify(_logits(P), drafts, sampler)
        alone = Sampler(params, [0])
        assert out == [alone.sample(_logits(P[j])) for j in range(len(out))]
        accepted += len(out) - 1
        rejected += len(out) < 4
        assert 5 not in out  # p never gives token 5, though q drafts it
    # q's inverse CDF meets p's on token 0 only at the first position (u < 0.1): about 0.23 kept per seed
    assert accepted > 300 and rejected > 1500


@pytest.mark.parametrize("drafter", ["draft_model", "self_spec"])
def test_sampled_drafters_give_the_standard_tiers_tokens_and_logprobs(tmp_path, drafter):
    """A draft model with other weights than the target's, or the target with layers skipped, drafting for
    seeded sampled requests: every seed's tokens and logprobs are the standard tier's, and drafts were both
    kept and rejected on the way."""
    write_tiny_gguf(tmp_path / "target.gguf", qtype=0, seed=3)
    write_tiny_gguf(tmp_path / "draft.gguf", qtype=0, seed=4)
    engine = Engine.from_path(tmp_path / "target.gguf", max_context=128, device="cpu", packed=True)
    engine.attach_draft_model(Engine.from_path(tmp_path / "draft.gguf", max_context=128, device="cpu", packed=True))
    engine.use_self_spec_layers("0")
    # every pass drafts 2 tokens: the timing-driven policy, on a loaded machine, could choose not to draft at all
    engine.fixed_draft_k = 2
    prompt, drafted, accepted = [5, 9, 20, 5, 9], 0, 0
    for seed in range(60):
        params = SamplingParams(temperature=0.35, top_p=0.95, seed=seed, max_tokens=12, ignore_eos=True,
                                repetition_penalty=1.1, logprobs=2)
        std = engine.generate(prompt, params)
        fast = engine.generate(prompt, params, tier="ultrafast", drafters=[drafter])
        assert fast.token_ids == std.token_ids, seed
        assert [(r.token_id, r.logprob, r.top) for r in fast.logprobs] == \
            [(r.token_id, r.logprob, r.top) for r in std.logprobs]
        assert [r.token_id for r in std.logprobs] == std.token_ids and len(std.logprobs[0].top) == 2
        d = fast.spec["drafters"][drafter]
        drafted, accepted = drafted + d["drafted"], accepted + d["accepted"]
    assert 0 < accepted < drafted

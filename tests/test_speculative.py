"""The ultrafast tier is lossless: greedy output identical to the standard tier on Spec-Bench prompts for
every drafter, and the sampled distribution unchanged (even under a drafter that proposes bad tokens)."""

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.builders import BadDrafter, write_tiny_gguf
from ultrafast.engine import Engine
from ultrafast.sampler import SamplingParams

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


def spec_bench_sample(per_category: int):
    """The first `per_category` first-turn questions of each Spec-Bench category (13 categories)."""
    if not SPEC_BENCH.exists():
        pytest.skip(f"Spec-Bench questions not found at {SPEC_BENCH}")
    seen, out = Counter(), []
    for line in SPEC_BENCH.read_text().splitlines():
        q = json.loads(line)
        if seen[q["category"]] < per_category:
            seen[q["category"]] += 1
            out.append(q["turns"][0])
    return out


@pytest.fixture(scope="module")
def spec_engine(smollm_path):
    engine = Engine.from_path(smollm_path, max_context=2048, device="cpu")
    # SmolLM2 has no smaller sibling: a second copy of itself stands in as the draft model (it tests the
    # mechanics: cache sync, rollback, acceptance); the Qwen 0.5B -> 1.5B pair is measured by the benchmark
    engine.attach_draft_model(Engine.from_path(smollm_path, max_context=2048, device="cpu"))
    # a draft as costly as the target never pays, and the policy rightly stops asking it; pretend it (and
    # self-speculation) is cheap so that these tests exercise their mechanics (cache sync, rollback, acceptance)
    engine.draft_cost = engine.self_spec_cost = 0.05
    engine.draft_feed_cost = 0.0  # (and its catch-up on each prompt free)
    return engine


@pytest.mark.parametrize("drafters", [["prompt_lookup"], ["suffix"], ["draft_model"], ["self_spec"],
                                      ["suffix", "prompt_lookup", "draft_model", "self_spec"]],
                         ids=lambda d: "+".join(d))
def test_greedy_ultrafast_equals_standard_on_spec_bench(spec_engine, drafters):
    prompts = spec_bench_sample(1)
    taus = []
    for text in prompts:
        ids = spec_engine.chat_prompt([{"role": "user", "content": text}])
        params = SamplingParams(max_tokens=128)
        std = spec_engine.generate(ids, params)
        fast = spec_engine.generate(ids, params, tier="ultrafast", drafters=drafters)
        assert fast.token_ids == std.token_ids, text[:80]
        assert fast.text == std.text and fast.finish_reason == std.finish_reason
        taus.append(fast.spec["tau"])
    assert sum(taus) / len(taus) > 1.0  # the drafters did get tokens accepted


def test_greedy_ultrafast_equals_standard_with_int8_activations(smollm_path):
    """With 8-bit activations (an engine-wide choice, both tiers) the tiers still agree token for token."""
    import ultrafast.kernels as uk

    if not uk.linear_path(uk.Q4_1, 8):
        pytest.skip("no integer kernels for 8-bit activations on this CPU")
    engine = Engine.from_path(smollm_path, max_context=2048, device="cpu", activation_bits=8)
    taus = []
    for text in spec_bench_sample(1)[:6]:
        ids = engine.chat_prompt([{"role": "user", "content": text}])
        std = engine.generate(ids, SamplingParams(max_tokens=96))
        fast = engine.generate(ids, SamplingParams(max_tokens=96), tier="ultrafast")
        assert fast.token_ids == std.token_ids, text[:80]
        taus.append(fast.spec["tau"])
    assert sum(taus) / len(taus) > 1.0


def test_bad_drafter_changes_nothing(spec_engine):
    ids = spec_engine.chat_prompt([{"role": "user", "content": "Write a limerick about a cat."}])
    for params in (SamplingParams(max_tokens=48), SamplingParams(max_tokens=48, temperature=0.8, seed=3)):
        std = spec_engine.generate(ids, params)
        fast = spec_engine.generate(ids, params, tier="ultrafast", drafters=[BadDrafter(49152)])
        assert fast.token_ids == std.token_ids


def test_stop_strings_and_eos_inside_an_accepted_run(spec_engine):
    ids = spec_engine.chat_prompt([{"role": "user", "content": "Count from 1 to 30, separated by commas."}])
    full = spec_engine.generate(ids, SamplingParams(max_tokens=100))
    stop = full.text[40:44]
    for params in (SamplingParams(max_tokens=100, stop=[stop]), SamplingParams(max_tokens=37)):
        std = spec_engine.generate(ids, params)
        fast = spec_engine.generate(ids, params, tier="ultrafast")
        assert (fast.token_ids, fast.text, fast.finish_reason) == (std.token_ids, std.text, std.finish_reason)


def test_sampling_distribution_is_unchanged(tmp_path):
    """Next-token distribution three tokens in, over many seeds: ultrafast (with a drafter that proposes
    bad tokens, and with prompt lookup) against standard, by a chi-square test at significance 0.001, and
    each tier against the model's own probabilities."""
    from scipy.stats import chi2_contingency, chisquare

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype=0, seed=3)
    engine = Engine.from_path(path, max_context=128, device="cpu", packed=True)
    prompt = [5, 9, 20, 5, 9]
    first = 2  # condition on the first two generated tokens, look at the third
    n_seeds = 600

    def third_tokens(**tier):
        out = []
        for seed in range(n_seeds):
            r = engine.generate(prompt, SamplingParams(temperature=0.35, seed=seed, max_tokens=3, ignore_eos=True), **tier)
            out.append(tuple(r.token_ids))
        return out

    std = third_tokens()
    bad = third_tokens(tier="ultrafast", drafters=[BadDrafter(engine.config.vocab_size, seed=1)])
    pl = third_tokens(tier="ultrafast", drafters=["prompt_lookup"])
    # the most common 2-token prefix, and the third token's counts after it
    prefix = Counter(t[:first] for t in std).most_common(1)[0][0]

    def counts(samples):
        return Counter(t[first] for t in samples if t[:first] == prefix)
    c_std, c_bad, c_pl = counts(std), counts(bad), counts(pl)
    assert sum(c_std.values()) >= 30
    tokens = sorted(set(c_std) | set(c_bad) | set(c_pl))
    table = [[c[t] for t in tokens] for c in (c_std, c_bad, c_pl)]
    assert chi2_contingency(table).pvalue > 0.001
    # and the standard tier follows the model's own distribution at that position
    logits = engine.forward(prompt + list(prefix), 0)[-1]
    probs = torch.softmax(logits.double() / 0.35, -1)
    n = sum(c_std.values())
    top = [t for t in range(len(probs)) if probs[t] * n >= 5]
    observed = [c_std[t] for t in top] + [n - sum(c_std[t] for t in top)]
    expected = [float(probs[t]) * n for t in top] + [n * (1 - float(sum(probs[t] for t in top)))]
    assert chisquare(observed, expected).pvalue > 0.001


class _ArgmaxEngine:
    """Logits whose argmax is always token 1: any other draft is rejected."""

    def forward(self, tokens, pos, all_logits=False, cache=None):
        out = torch.zeros(len(tokens) if all_logits else 1, 4)
        out[:, 1] = 1.0
        return out


class _Greedy:
    def __init__(self):
        self.history = []

    def sample(self, logits):
        tok = int(logits.argmax())
        self.history.append(tok)
        return tok


class _WrongDrafter:
    name = "wrong"

    def begin(self, prompt_ids):
        pass

    def propose(self, context, k, sampler=None):
        return [2] * k

    def end(self, context):
        pass


@pytest.mark.parametrize("r2", [1.2, 1.5, 2.0])
def test_useless_drafter_costs_at_most_the_probe_budget(r2):
    """With drafts that are never accepted, speculation falls back to plain steps and only probes, one token
    at a time, as rarely as the cost of a second row asks: the cost per token stays within the budget."""
    from ultrafast.speculative import SpeculativeStepper

    r = [0.0, 1.0] + [1.0 + (r2 - 1.0) * (k - 1) for k in range(2, 18)]
    st = SpeculativeStepper(_ArgmaxEngine(), None, [_WrongDrafter()], r)
    sampler = _Greedy()
    for pos in range(400):
        assert st.step(1, pos, sampler, 64) == [1]
    probes = st.stats.by_drafter["wrong"].passes
    assert probes >= 400 // (st.probe_interval() + 1) - 3  # it keeps probing
    assert st.stats.cost / st.stats.emitted <= 1.0 + SpeculativeStepper.PROBE_BUDGET + 0.01


class _TwoKindsDrafter:
    """Short matches (1 token) propose wrong tokens, long ones (20 tokens) the right ones (argmax 1)."""
    name = "two_kinds"

    def __init__(self):
        self.match_len, self.calls = 0, 0

    def begin(self, prompt_ids):
        pass

    def propose(self, context, k, sampler=None):
        self.calls += 1
        long = self.calls % 2 == 0
        self.match_len = 20 if long else 1
        return [1 if long else 2] * k

    def end(self, context):
        pass


def test_acceptance_is_kept_per_match_length_class():
    """The long matches' record earns them long drafts although the short matches keep failing."""
    from ultrafast.speculative import SpeculativeStepper, match_class

    assert [match_class(n) for n in (0, 1, 2, 3, 4, 7, 8, 15, 16, 100)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    r = [0.0, 1.0] + [1.0 + 0.4 * (k - 1) for k in range(2, 18)]
    st = SpeculativeStepper(_ArgmaxEngine(), None, [_TwoKindsDrafter()], r)
    sampler = _Greedy()
    emitted = [len(st.step(1, pos, sampler, 64)) for pos in range(200)]
    rates = st.stats.by_drafter["two_kinds"].rates
    assert rates[5] > 0.95 and rates[1] < 0.5  # (short ones are then only probed now and then)
    assert max(emitted[-20:]) >= 6  # long drafts accepted whole


def test_acceptance_weighs_each_drafted_token():
    """A long run of right drafts and one rejection (an edit in a file being copied) keeps the rate high: it
    is accepted / trials over recent passes, not an average over passes."""
    from ultrafast.speculative import DrafterStats

    st = DrafterStats()
    for _ in range(10):
        st.record(5, 7, 7)
    assert st.rates[5] > 0.99 and st.rate > 0.99
    st.record(5, 0, 1)
    assert 0.9 < st.rates[5] < 0.99  # a per-pass average would have dropped to ~0.7
    st.record(1, 0, 1)
    st.record(1, 0, 1)
    assert st.rates[1] < 0.35 and st.rates[5] > 0.9  # classes apart; the drafter's own rate counts both
    assert st.rate < st.rates[5]


class _Lookup:
    """A lookup that proposes k tokens of `token` at a fixed match length."""

    def __init__(self, name, token, match_len):
        self.name, self.token, self.match_len, self.calls = name, token, match_len, 0

    def begin(self, prompt_ids):
        pass

    def propose(self, context, k, sampler=None):
        self.calls += 1
        return [self.token] * k

    def end(self, context):
        pass


def test_every_lookup_is_asked_and_the_best_proposal_taken():
    """Two free lookups propose every pass; the one whose match class has been right is verified although the
    other comes first and has the better record overall."""
    from ultrafast.speculative import SpeculativeStepper

    r = [0.0, 1.0] + [1.0 + 0.1 * (k - 1) for k in range(2, 18)]
    wrong, right = _Lookup("wrong", 2, 1), _Lookup("right", 1, 20)
    st = SpeculativeStepper(_ArgmaxEngine(), None, [wrong, right], r)
    st.stats.by_drafter["wrong"].rate = 0.9  # asked first
    sampler = _Greedy()
    emitted = [len(st.step(1, pos, sampler, 64)) for pos in range(30)]
    assert wrong.calls == right.calls == 30
    assert st.stats.by_drafter["wrong"].passes <= 1 and st.stats.by_drafter["right"].passes >= 29
    assert min(emitted[3:]) > 8  # long drafts, once its class has a record


def test_speedup_ceiling():
    from ultrafast.speculative import speedup_ceiling

    # each extra row costs 0.5 of a step, and 2 from 5 rows on: the best is 4 tokens for 2.5 steps
    r = [0.0, 1.0, 1.5, 2.0, 2.5, 4.5, 6.5]
    assert speedup_ceiling(r) == (4 / 2.5, 3)
    assert speedup_ceiling([0.0, 1.0, 2.0])[0] == 1.0  # a second row as dear as a step: nothing to gain


def test_expected_speedup():
    from ultrafast.speculative import expected_speedup

    flat = [0.0] + [1.0] * 9  # r(1..9) = 1: verification free per row
    assert expected_speedup(1.0, flat) == (9.0, 8)  # always right, free: the longest draft r allows
    gain, k = expected_speedup(0.5, [0.0, 1.0, 1.5, 2.0, 2.5], draft_cost=0.0)
    assert (gain, k) == (max(1.5 / 1.5, 1.75 / 2.0, 1.875 / 2.5), 1)
    assert expected_speedup(0.9, flat, draft_cost=0.5, limit=2)[1] <= 2
    assert expected_speedup(0.0, flat, draft_cost=0.7)[0] < 1.0  # never right: the policy would not draft


class _Empty(_WrongDrafter):
    name = "empty"

    def propose(self, context, k, sampler=None):
        return []


def test_fixed_k_drafts_every_pass_with_the_drafters_taking_turns():
    from ultrafast.speculative import SpeculativeStepper

    r = [0.0, 1.0] + [1.0 + 0.4 * (k - 1) for k in range(2, 18)]
    two = _TwoKindsDrafter()
    st = SpeculativeStepper(_ArgmaxEngine(), None, [_WrongDrafter(), _Empty(), two], r, fixed_k=3)
    sampler = _Greedy()
    for pos in range(10):
        st.step(1, pos, sampler, 64)
    by = st.stats.by_drafter
    # no policy: the wrong drafter keeps its turns, the empty one passes its turn on
    assert by["wrong"].passes == 5 and by["two_kinds"].passes == 5 and by["empty"].passes == 0
    assert by["wrong"].drafted == 15 and st.stats.plain_steps == 0
    assert st.step(1, 10, sampler, 2) and by["wrong"].drafted + by["two_kinds"].drafted == 31  # limit - 1 drafts
    for bad in (0, 17):
        with pytest.raises(ValueError, match="fixed draft length"):
            SpeculativeStepper(_ArgmaxEngine(), None, [two], r, fixed_k=bad)


def test_fixed_k_with_every_drafter_equals_standard(spec_engine):
    """Every pass drafts (4 drafters in turn, the draft model a second copy of the target): still the
    standard tier's tokens."""
    spec_engine.fixed_draft_k = 4
    try:
        for text in spec_bench_sample(1)[:4]:
            ids = spec_engine.chat_prompt([{"role": "user", "content": text}])
            std = spec_engine.generate(ids, SamplingParams(max_tokens=64))
            fast = spec_engine.generate(ids, SamplingParams(max_tokens=64), tier="ultrafast",
                                        drafters=["suffix", "prompt_lookup", "self_spec", "draft_model"])
            assert fast.token_ids == std.token_ids, text[:80]
            d = fast.spec["drafters"]
            assert fast.spec["plain_steps"] <= 1  # (the last pass, with one token left to emit)
            assert d["self_spec"]["passes"] > 0 and d["draft_model"]["passes"] > 0  # (lookups: when they match)
    finally:
        spec_engine.fixed_draft_k = None


class _CostlyRight:
    """A draft model stand-in: always right (argmax 1), one forward per token, and a catch-up to pay."""
    name = "costly"
    cost_per_token = 0.05

    def __init__(self, catch_up):
        self.catch_up = catch_up

    def begin(self, prompt_ids):
        pass

    def catch_up_cost(self, context):
        return self.catch_up

    def propose(self, context, k, sampler=None):
        return [1] * k

    def end(self, context):
        pass


def test_catch_up_cost_is_charged():
    """A drafter that must first feed a long prompt (100 steps' worth) is not asked, nor probed within 200
    steps; the same drafter in step with the context drafts from the first pass."""
    from ultrafast.speculative import SpeculativeStepper

    r = [0.0, 1.0] + [1.0 + 0.4 * (k - 1) for k in range(2, 18)]
    for catch_up, used in ((100.0, False), (0.0, True)):
        st = SpeculativeStepper(_ArgmaxEngine(), None, [_CostlyRight(catch_up)], r)
        sampler = _Greedy()
        for pos in range(200):
            st.step(1, pos, sampler, 64)
        assert (st.stats.by_drafter["costly"].passes > 0) == used
        assert st.probe_interval(0.05, catch_up) > 200 or used


def test_drafting_cost_is_counted_apart_from_the_verify_cost():
    """A drafter with a cost per token (a draft model, a head) charges each pass its drafts at that cost, in
    `draft_cost`, beside the verify passes' r(k) in `cost` (what the server weighs against a batched pass);
    the lookups cost nothing."""
    from ultrafast.speculative import SpeculativeStepper

    r = [0.0, 1.0] + [1.0 + 0.4 * (k - 1) for k in range(2, 18)]
    st = SpeculativeStepper(_ArgmaxEngine(), None, [_CostlyRight(0.0)], r)
    sampler = _Greedy()
    drafted = 0
    for pos in range(20):
        st.step(1, pos, sampler, 64)
        drafted = st.stats.by_drafter["costly"].drafted
        assert st.stats.draft_cost == pytest.approx(0.05 * drafted)
    assert drafted > 0
    lookup = SpeculativeStepper(_ArgmaxEngine(), None, [_TwoKindsDrafter()], r)
    for pos in range(20):
        lookup.step(1, pos, sampler, 64)
    assert lookup.stats.by_drafter["two_kinds"].drafted > 0 and lookup.stats.draft_cost == 0.0


def test_a_shared_pass_keeps_the_drafts_that_pay_for_their_rows():
    """share_rows: the most valuable drafts of all plans (a prefix of each chain), as many as maximise expected
    tokens per unit of the pass's cost; none where rows cost too much for what the drafts are worth; a probe's
    first draft whatever it is worth."""
    from ultrafast.speculative import DraftPlan, batch_cost, drafts_may_pay, share_rows

    def plan(rate, n, probe=False):
        return DraftPlan(None, list(range(n)), 1, [rate ** j for j in range(1, n + 1)], probe)

    cheap = [0.0, 1.0] + [1.0 + 0.05 * (k - 1) for k in range(2, 18)]  # 0.05 of a step a row
    dear = [0.0, 1.0] + [float(k) for k in range(2, 18)]  # a whole step a row: no draft earns its row
    # a right-most-of-the-time copy and an unlikely guess, beside a request with nothing to draft
    plans = [plan(0.9, 6), plan(0.1, 3), None]
    keep = share_rows(plans, cheap)
    assert keep[0] == 6 and keep[1] in (0, 1) and keep[2] == 0
    assert share_rows(plans, dear) == [0, 0, 0]
    # the choice is the best ratio over the ranked drafts: check it against every split by brute force
    plans = [plan(0.8, 5), plan(0.5, 5), plan(0.3, 4)]
    mid = [0.0, 1.0] + [1.0 + 0.2 * (k - 1) for k in range(2, 18)]
    keep = share_rows(plans, mid)
    best = max((sum(1 + sum(p.values[:k]) for p, k in zip(plans, ks)) / batch_cost(mid, sum(1 + k for k in ks)), ks)
               for ks in __import__("itertools").product(range(6), range(6), range(5)))
    got = sum(1 + sum(p.values[:k]) for p, k in zip(plans, keep)) / batch_cost(mid, sum(1 + k for k in keep))
    assert abs(got - best[0]) < 1e-9, (keep, best)
    # a probe is verified even where rows are dear; the rest as before
    assert share_rows([plan(0.05, 3, probe=True), plan(0.05, 3)], dear) == [1, 0]
    # beyond the measured r(k), a pass costs its rows at the largest k's rate
    assert batch_cost(cheap, 34) == cheap[17] * 2
    # where even sure drafts cannot beat the plain rows, the drafters need not be asked
    assert drafts_may_pay(3, cheap) and not drafts_may_pay(3, dear) and not drafts_may_pay(0, cheap)


def test_a_plan_whose_rows_several_candidates_take_counts_for_each():
    """Best-of-n twins (candidates with the same tokens so far) take one plan's rows between them: each of its
    draft rows earns a token for every twin, so rows too dear for one generation's drafts can pay for a group's."""
    import itertools

    from ultrafast.speculative import DraftPlan, batch_cost, drafts_may_pay, share_rows

    def plan(rate, n):
        return DraftPlan(None, list(range(n)), 1, [rate ** j for j in range(1, n + 1)])

    dear = [0.0, 1.0] + [float(k) for k in range(2, 18)]  # a whole step a row
    plans = [plan(0.9, 3), plan(0.9, 3)]
    assert share_rows(plans, dear) == [0, 0] and not drafts_may_pay(2, dear)
    assert drafts_may_pay(2, dear, [3, 1])
    keep = share_rows(plans, dear, weights=[3, 1])
    assert keep[0] >= 1 and keep[1] == 0

    def rate(ks):
        return (4 + sum(w * sum(p.values[:k]) for p, k, w in zip(plans, ks, (3, 1)))) / batch_cost(dear, 2 + sum(ks))

    assert rate(keep) == max(rate(ks) for ks in itertools.product(range(4), range(4)))
    assert share_rows(plans, dear, weights=[1, 1]) == share_rows(plans, dear)
    with pytest.raises(ValueError, match="weights"):
        share_rows(plans, dear, weights=[1])

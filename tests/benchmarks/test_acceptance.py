"""`ultrafast acceptance`: drafters' acceptance per depth on the target's own greedy answers."""

import json

import pytest

from ultrafast.benchmarks.acceptance import Tally, Walk, chain_accepted, draft_rows, measure, tree_accepted
from ultrafast.sampler import SamplingParams


def test_tally_gives_acceptance_per_depth_and_tau():
    t = Tally(3)
    for proposed, accepted in [(3, 3), (3, 1), (0, 0), (2, 2)]:
        t.add(proposed, accepted)
    s = t.summary()
    assert s["positions"] == 4 and s["proposed"] == 0.75
    assert s["acceptance_by_depth"] == [0.75, round(2 / 3, 4), 0.5]  # 3 of 4, then 2 of 3, then 1 of 2
    assert s["tau_by_length"] == [1.75, 2.25, 2.5]  # 1 + mean of min(accepted, k)


def test_a_walk_skips_the_positions_a_pass_accepted_and_counts_the_rows_it_verified():
    w = Walk(2)
    # (draft rows at chain length 1, 2; accepted length) at five positions of one answer
    w.add([([1, 2], 2), ([1, 2], 0), ([1, 1], 1), ([0, 0], 0), ([1, 2], 2)])
    s = w.summary()
    # k = 1: passes at 0, 2, 4, each emitting 2 tokens for 1 draft row; k = 2: at 0 (3 tokens), 3 (1), 4 (3)
    assert s["tau_by_length"] == [2.0, round(7 / 3, 3)] and s["drafts_by_length"] == [1.0, round(4 / 3, 2)]
    got = {"prompt_lookup": (3, 1), "suffix": (0, 0), "head tree 6": (6, 2)}
    trees = frozenset({"head tree 6"})
    assert draft_rows("prompt_lookup", got, 2, [], trees) == 2 and draft_rows("head tree 6", got, 1, [], trees) == 6
    assert draft_rows("head tree 6", got, 1, [], frozenset()) == 1  # a name outside `trees` is a chain, cut to k
    assert draft_rows("joined", got, 2, ["prompt_lookup", "suffix", "head tree 6"], trees) == 2 + 0 + 6


def test_chains_and_trees_are_accepted_up_to_the_first_wrong_token():
    assert chain_accepted([5, 6, 7], [5, 6, 8]) == 2 and chain_accepted([], [1]) == 0
    # root -> 5 (1) -> 6 (3); root -> 9 (2) -> 6 (4) -> 7 (5)
    toks, parents = [5, 9, 6, 6, 7], [0, 0, 1, 2, 4]
    assert tree_accepted(toks, parents, [9, 6, 7, 1], 5) == 3
    assert tree_accepted(toks, parents, [9, 6, 7, 1], 4) == 2  # node 5 is past a 4-node budget
    assert tree_accepted(toks, parents, [5, 6, 7], 5) == 2 and tree_accepted(toks, parents, [1], 5) == 0


def test_acceptance_on_the_targets_greedy_answers(smollm_path, tiny_head):
    """The answers drafted against are the standard tier's; every drafter is measured at every position; the
    head's trees accept at least what its own chain's first token does, and more with a larger budget."""
    from ultrafast.engine import Engine

    engine = Engine.from_path(smollm_path, max_context=1024)
    engine.attach_draft_head(tiny_head[1])
    qs = ["List the planets of the solar system, one per line.", "Write a Python function that adds two numbers.",
          "What is the capital of France? Repeat the answer three times."]
    prompts = [engine.chat_prompt([{"role": "user", "content": q}]) for q in qs]
    r = measure(engine, prompts, max_tokens=24, depth=3, nodes=(2, 6), batch=2, labels=["a", "b", "a"],
                progress_file=None)
    std = [engine.generate(p, SamplingParams(max_tokens=24)).token_ids for p in prompts]
    assert r["generated_tokens"] == sum(len(t) + (len(t) < 24) for t in std)  # an EOS counts as generated
    o = r["overall"]
    assert set(o) == {"prompt_lookup", "suffix", "head", "head tree 2", "head tree 6", "joined"}
    positions = sum(len(t) + (len(t) < 24) - 3 for t in std)  # from the 2nd generated token, a whole chain left
    assert {s["positions"] for s in o.values()} == {positions}
    assert o["head"]["proposed"] == 1.0 and o["head tree 6"]["proposed"] == 1.0
    assert o["head tree 2"]["tau_by_length"][-1] >= o["head"]["tau_by_length"][0] - 1e-9
    assert o["head tree 6"]["tau_by_length"][-1] >= o["head tree 2"]["tau_by_length"][-1]
    for s in o.values():
        assert all(0.0 <= a <= 1.0 for a in s["acceptance_by_depth"])
        assert s["tau_by_length"] == sorted(s["tau_by_length"])
    # the joined tree holds the lookups' chains and the largest head tree: it accepts the longest of them
    for name in ("prompt_lookup", "suffix", "head tree 6"):
        assert o["joined"]["tau_by_length"][-1] >= o[name]["tau_by_length"][-1] - 1e-9
        assert o["joined"]["proposed"] >= o[name]["proposed"]
    assert o["joined"]["tau_by_length"][-1] <= sum(o[n]["tau_by_length"][-1] - 1
                                                   for n in ("prompt_lookup", "suffix", "head tree 6")) + 1 + 1e-9
    assert set(r["by_label"]) == {"a", "b"}
    w = r["walked"]
    assert set(w) == set(o)
    for name, s in w.items():
        assert all(1.0 <= t <= k + 1 for k, t in enumerate(s["tau_by_length"], 1))
        if name != "joined":
            assert all(d <= (6 if "tree" in name else k) for k, d in enumerate(s["drafts_by_length"], 1))
    assert w["joined"]["drafts_by_length"][0] >= w["head tree 6"]["drafts_by_length"][0]
    strided = measure(engine, prompts[:1], max_tokens=8, depth=2, nodes=(2,), stride=2, progress_file=None)
    assert strided["walked"] is None  # a walk needs every position
    with pytest.raises(ValueError):
        measure(engine, prompts, max_tokens=24, stride=0, progress_file=None)
    with pytest.raises(ValueError):
        measure(engine, prompts, max_tokens=24, nodes=(), progress_file=None)


def test_ctrl_c_while_drafting_keeps_the_questions_finished(smollm_path, monkeypatch):
    """Interrupted amid its second question, the run reports the first one whole, and says it was cut."""
    from ultrafast.drafters.prompt_lookup import PromptLookupDrafter
    from ultrafast.engine import Engine

    engine = Engine.from_path(smollm_path, max_context=1024)
    prompts = [engine.chat_prompt([{"role": "user", "content": q}])
               for q in ("Name three colours.", "Count from one to ten in words.")]
    whole = measure(engine, prompts[:1], max_tokens=16, depth=2, progress_file=None)
    begin, propose = PromptLookupDrafter.begin, PromptLookupDrafter.propose
    calls = {"begin": 0, "propose": 0}

    def counted_begin(self, prompt):
        calls["begin"] += 1
        return begin(self, prompt)

    def interrupted_propose(self, context, k, *a, **kw):
        if calls["begin"] == 2:  # the third position of the second answer
            calls["propose"] += 1
            if calls["propose"] == 3:
                raise KeyboardInterrupt
        return propose(self, context, k, *a, **kw)

    monkeypatch.setattr(PromptLookupDrafter, "begin", counted_begin)
    monkeypatch.setattr(PromptLookupDrafter, "propose", interrupted_propose)
    cut = measure(engine, prompts, max_tokens=16, depth=2, progress_file=None)
    assert calls["propose"] == 3  # it was cut amid the second answer
    assert cut["interrupted"] and cut["questions"] == 1 and not whole["interrupted"]
    assert cut["overall"] == whole["overall"] and cut["generated_tokens"] == whole["generated_tokens"]


def test_acceptance_cli_writes_a_table_json_and_picture(tmp_path, capsys, monkeypatch):
    from ultrafast.cli import main

    qs = tmp_path / "q.jsonl"
    qs.write_text("\n".join(json.dumps({"category": c, "turns": [f"Say {w} twice."]})
                            for c, w in [("writing", "hello"), ("qa", "yes")]) + "\n")
    out = tmp_path / "acc.json"
    assert main(["acceptance", "--model", "smollm2-135m", "--questions", str(qs), "--draft-head", "none",
                 "--max-tokens", "12", "--depth", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| prompt_lookup |" in text and "| suffix |" in text and "| joined |" in text and "| mt_bench |" in text
    blob = json.loads(out.read_text())
    assert blob["questions"] == 2 and blob["draft_head"] is None and out.with_suffix(".png").stat().st_size > 0
    assert main(["acceptance", "--model", "smollm2-135m", "--questions", str(qs), "--nodes", "4,x"]) == 2
    assert capsys.readouterr().err.startswith("error:")

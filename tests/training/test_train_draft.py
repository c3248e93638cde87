"""`ultrafast train-draft`: a tiny head on SmolLM2 in seconds (the `tiny_head` fixture), the corpus, resuming."""

import io
import json

import pytest
import torch

from ultrafast.draft_head import read_head_file
from ultrafast.training import Recipe, train_draft
from ultrafast.training.corpus import build_corpus, build_prompts, parse_conversations
from ultrafast.training.features import continue_greedily, extract, sequence_features


def test_a_tiny_head_learns_and_beats_an_untrained_one(tiny_head):
    report, path = tiny_head
    assert report["loss_last"] < 0.8 * report["loss_first"]
    trained, untrained = report["heldout"], report["heldout_untrained"]
    assert trained["counted_by_depth"][0] > 500  # held-out positions measured at depth 1
    assert trained["acceptance_by_depth"][0] > untrained["acceptance_by_depth"][0] + 0.1
    assert trained["tau_by_chain_length"][2] > untrained["tau_by_chain_length"][2]
    blob = read_head_file(path)
    assert json.loads(blob["recipe"])["tokens"] == 5000 and "modules" in json.loads(blob["data"])["code"]
    assert report["size_bytes"] == path.stat().st_size and report["peak_rss_mb"] > 0
    assert report["train_seconds"] > 0 and report["feature_seconds"] > 0
    curve = report["heldout_by_epoch"]  # held-out acceptance against training time: after each of 3 epochs
    assert len(curve) == 3 and [c["step"] for c in curve] == sorted({c["step"] for c in curve})
    assert 0 < curve[0]["train_seconds"] < curve[-1]["train_seconds"] <= report["train_seconds"]
    assert curve[-1]["acceptance_by_depth"] == trained["acceptance_by_depth"][:3]


def test_a_finished_run_resumes_from_its_shards_and_checkpoint(tiny_head, smollm_path):
    """Same recipe, same work dir: features come from the shards, training from the last checkpoint (here
    the end), and the result is the same head."""
    from tests.conftest import docstring_conversations

    report, path = tiny_head
    work = path.parent / "work"
    shards = sorted(work.glob("features-*/*.pt"))
    assert shards and len(list(work.glob("train-*.ckpt.pt"))) == 1
    before = {p: p.stat().st_mtime_ns for p in shards}
    log = io.StringIO()
    again = train_draft(str(smollm_path), Recipe(**json.loads(read_head_file(path)["recipe"])),
                        out=path.parent / "again.pt", work_dir=work, stream=log,
                        conversations=docstring_conversations())
    assert "resuming at step" in log.getvalue()
    assert {p: p.stat().st_mtime_ns for p in shards} == before  # read, not rewritten
    assert again["heldout"] == report["heldout"] and again["loss_last"] == report["loss_last"]
    assert again["heldout_by_epoch"][:2] == report["heldout_by_epoch"][:2]  # the curve came with the checkpoint
    a, b = read_head_file(path)["state"], read_head_file(path.parent / "again.pt")["state"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_training_features_come_from_the_bf16_forward_and_held_out_ones_from_the_engine(tiny_head, smollm_engine):
    """The default recipe's training shards hold the bf16 forward's features (bf16.py: near the engine's, not
    equal); the held-out shards hold the engine's own, bit for bit, as the head reads them when drafting."""
    from ultrafast.engine import Engine

    _, path = tiny_head
    (fdir,) = (path.parent / "work").glob("features-*")
    train = torch.load(fdir / "train-00000.pt", weights_only=True)
    held = torch.load(fdir / "heldout-00000.pt", weights_only=True)
    for ids, feats, greedy in zip(held["tokens"], held["feats"], held["greedy"]):
        f, g = sequence_features(smollm_engine, ids.tolist(), smollm_engine.new_cache())
        assert torch.equal(f, feats) and torch.equal(g.to(torch.int32), greedy)
    bf16 = Engine.from_loaded(smollm_engine.loaded, max_context=256, device="cpu", bf16=True)
    ids, feats, greedy = train["tokens"][0], train["feats"][0], train["greedy"][0]
    f, g = sequence_features(bf16, ids.tolist(), bf16.new_cache())
    assert torch.equal(f, feats) and torch.equal(g.to(torch.int32), greedy)
    packed, pg = sequence_features(smollm_engine, ids.tolist(), smollm_engine.new_cache())
    assert not torch.equal(packed, feats)
    rel = (packed.float() - feats.float()).norm(dim=-1) / packed.float().norm(dim=-1)
    assert rel.mean() < 0.05 and (pg.to(torch.int32) == greedy).float().mean() > 0.9


def test_packed_features_keep_the_shards_of_runs_before_the_choice():
    """`--features packed` is what every run made before bf16 existed: its data key is theirs."""
    assert Recipe(features="packed").data_key() != Recipe().data_key()
    assert Recipe(features="packed", source="greedy").data_key() == Recipe(source="greedy", features="packed").data_key()
    import hashlib

    old = {k: getattr(Recipe(), k) for k in ("tokens", "seq_len", "code_share", "heldout", "seed")}
    assert Recipe(features="packed").data_key() == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:12]


def test_a_checkpoint_key_changes_with_what_a_run_computes_not_with_its_batch_of_continuations():
    assert Recipe(gen_batch=4).key() == Recipe(gen_batch=16).key()
    assert Recipe(gen_batch=4).data_key() == Recipe().data_key()
    for changed in (Recipe(lr=3e-3), Recipe(epochs=3), Recipe(source="greedy"), Recipe(extra_layers="eagle3")):
        assert changed.key() != Recipe().key()


def test_truncated_sharegpt_json_gives_its_complete_conversations():
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
             for i in range(5)]
    text = json.dumps(convs, indent=2)
    cut = text[:text.index('"id": "4"') + 12]  # the last object is cut short, as in the wheel
    got = parse_conversations(cut)
    assert [c[0]["content"] for c in got] == ["q0", "q1", "q2", "q3"]
    assert got[0] == [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0"}]
    bad = [{"conversations": [{"from": "gpt", "value": "no question"}]}, {"conversations": "nonsense"}, 7]
    assert parse_conversations(json.dumps(bad)) == []


def test_corpus_holds_out_conversations_and_cuts_sequences(smollm_engine):
    from tests.conftest import docstring_conversations

    convs = docstring_conversations()
    c = build_corpus(smollm_engine.tokenizer, tokens=3000, seq_len=64, code_share=0.5, heldout=5, seed=1,
                     conversations=convs)
    assert len(c.heldout) == 5 and all(len(s) <= 64 for s in c.train + c.heldout)
    assert 3000 <= sum(map(len, c.train)) <= 3000 + 2 * 64
    assert not {tuple(s) for s in c.heldout} & {tuple(s) for s in c.train}
    again = build_corpus(smollm_engine.tokenizer, tokens=3000, seq_len=64, code_share=0.5, heldout=5, seed=1,
                         conversations=convs)
    assert again.train == c.train  # a fixed order: a resumed run sees the same data


def test_prompts_are_first_turns_held_out_as_the_text_corpus(smollm_engine):
    from tests.conftest import docstring_conversations

    convs = docstring_conversations()
    tok = smollm_engine.tokenizer
    kw = dict(tokens=3200, seq_len=128, code_share=0.25, heldout=5, seed=1, conversations=convs)
    p = build_prompts(tok, **kw)
    text = build_corpus(tok, **kw)
    assert all(8 <= len(s) <= 64 for s in p.train + p.heldout)
    n_code = sum("Continue the Python module" in tok.decode(s) for s in p.train)
    # 3200 // 32 + 16 prompts asked for, a quarter of them code (fewer where no opening lines fit 64 tokens)
    assert len(p.train) - n_code == 87 and 10 <= n_code <= 29
    # the held-out prompts open the held-out conversations of the text corpus
    assert [s[:len(q) - 4] for s, q in zip(text.heldout, p.heldout)] == [q[:-4] for q in p.heldout]
    assert not {tuple(s) for s in p.heldout} & {tuple(s) for s in p.train}


def test_greedy_continuations_are_the_targets_own_and_do_not_depend_on_the_batch(smollm_engine, tmp_path):
    """Continued in batched one-row passes, each sequence is the target's greedy text, and its features and
    labels equal one forward over the whole sequence, bit for bit; the shards are the same whatever the batch."""
    tok = smollm_engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_bos=False)
               for q in ("What is a list?", "Name three colours.", "Why is the sky blue?")]
    got = dict(continue_greedily(smollm_engine, enumerate(prompts), 48, batch=2))
    assert sorted(got) == [0, 1, 2]
    for ids, (tokens, feats, greedy) in zip(prompts, [got[i] for i in range(3)]):
        n = len(ids)
        assert tokens[:n].tolist() == ids and tokens.numel() <= 48
        assert torch.equal(tokens[n:], greedy[n - 1:-1])  # every continued token is the target's argmax
        assert tokens.numel() == 48 or int(greedy[-1]) in tok.eos_ids
        f, g = sequence_features(smollm_engine, tokens.tolist(), smollm_engine.new_cache())
        assert torch.equal(f, feats) and torch.equal(g.to(torch.int32), greedy)
    quick = dict(continue_greedily(smollm_engine, enumerate(prompts), 48, batch=3, prompt_labels=False))
    for ids, i in zip(prompts, range(3)):  # the LM head skipped on the prompts' rows: the same continuations
        n = len(ids)
        assert torch.equal(quick[i][0], got[i][0]) and torch.equal(quick[i][1], got[i][1])
        assert torch.equal(quick[i][2][n - 1:], got[i][2][n - 1:]) and (quick[i][2][:n - 1] == -1).all()
    one = extract(smollm_engine, prompts, tmp_path / "b1", "x", continue_to=48, batch=1)
    three = extract(smollm_engine, prompts, tmp_path / "b3", "x", continue_to=48, batch=3)
    for a, b in ((one.tokens, three.tokens), (one.feats, three.feats), (one.greedy, three.greedy)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    again = extract(smollm_engine, prompts, tmp_path / "b1", "x", continue_to=48, batch=2)  # read back
    assert all(torch.equal(x, y) for x, y in zip(again.feats, one.feats))
    with pytest.raises(ValueError, match="other sequences"):
        extract(smollm_engine, prompts[::-1], tmp_path / "b1", "x", continue_to=48)
    with pytest.raises(ValueError, match="nothing to continue"):
        extract(smollm_engine, prompts, tmp_path / "short", "x", continue_to=len(prompts[0]))


def test_a_tiny_head_trains_on_the_targets_own_continuations(smollm_path, tmp_path):
    from tests.conftest import docstring_conversations

    recipe = Recipe(tokens=3000, seq_len=160, epochs=2, depth=2, lr=2e-3, batch_tokens=384, draft_vocab=2048,
                    code_share=0.3, heldout=6, source="greedy", gen_batch=8)
    report = train_draft(str(smollm_path), recipe, out=tmp_path / "head.pt", work_dir=tmp_path / "work",
                         stream=io.StringIO(), conversations=docstring_conversations())
    assert report["source"] == "greedy" and 3000 <= report["train_tokens"] < 3000 + 16384
    assert report["heldout_tokens"] > 6 * 60  # six held-out prompts and their continuations
    assert report["loss_last"] < 0.8 * report["loss_first"]
    trained, untrained = report["heldout"], report["heldout_untrained"]
    assert trained["acceptance_by_depth"][0] > untrained["acceptance_by_depth"][0] + 0.1
    assert "continued by" in json.loads(read_head_file(tmp_path / "head.pt")["data"])["sharegpt"]


@pytest.mark.parametrize("bad", [{"tokens": 0}, {"seq_len": 8}, {"lr": 0.0}, {"epochs": 0}, {"draft_vocab": -1},
                                 {"source": "web"}, {"gen_batch": 0}, {"features": "fp8"}, {"extra_layers": "low"}])
def test_bad_recipes_are_refused(bad):
    with pytest.raises(ValueError):
        Recipe(**bad).validate()


def test_extra_layers_name_distinct_layers_below_the_last():
    assert Recipe().layers_for(30) == () and Recipe(extra_layers="eagle3").layers_for(30) == (2, 15)
    assert Recipe(extra_layers="12,3").layers_for(30) == (3, 12)
    for bad in ("3,3", "29", "-1"):
        with pytest.raises(ValueError, match="extra-layers"):
            Recipe(extra_layers=bad).layers_for(30)


def test_train_draft_cli_refuses_bad_values(capsys):
    from ultrafast.cli import main

    assert main(["train-draft", "--model", "smollm2-135m", "--epochs", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "epochs" in err
    with pytest.raises(SystemExit) as e:
        main(["train-draft", "--model", "smollm2-135m", "--source", "web"])
    assert e.value.code == 2 and "--source" in capsys.readouterr().err


def test_int8_features_come_from_the_packed_kernels_at_8_bit_activations(smollm_path, smollm_engine, tmp_path):
    """`--features int8`: the training shards hold the engine's features at 8-bit activations, bit for bit; the
    held-out ones stay the engine's as it serves (16-bit); and a head trains on them. `--bf16 0` trains in fp32."""
    from tests.conftest import docstring_conversations
    from ultrafast import kernels
    from ultrafast.engine import Engine

    if not kernels.available() or not kernels.linear_path(kernels.Q4_1, 8):
        pytest.skip("no integer kernels for SmolLM2's types on this CPU")
    recipe = Recipe(tokens=1500, seq_len=128, epochs=1, depth=2, lr=2e-3, batch_tokens=384, draft_vocab=1024,
                    heldout=4, features="int8", bf16=False)
    report = train_draft(str(smollm_path), recipe, out=tmp_path / "head.pt", work_dir=tmp_path / "work",
                         stream=io.StringIO(), conversations=docstring_conversations())
    assert report["train_precision"] == "fp32" and report["steps"] > 0 and 0 < report["loss_last"] < float("inf")
    assert json.loads(read_head_file(tmp_path / "head.pt")["recipe"])["features"] == "int8"
    (fdir,) = (tmp_path / "work").glob("features-*")
    train = torch.load(fdir / "train-00000.pt", weights_only=True)
    held = torch.load(fdir / "heldout-00000.pt", weights_only=True)
    int8 = Engine.from_loaded(smollm_engine.loaded, max_context=256, device="cpu", activation_bits=8)
    ids, feats, greedy = train["tokens"][0], train["feats"][0], train["greedy"][0]
    f, g = sequence_features(int8, ids.tolist(), int8.new_cache())
    assert torch.equal(f, feats) and torch.equal(g.to(torch.int32), greedy)
    packed, _ = sequence_features(smollm_engine, ids.tolist(), smollm_engine.new_cache())
    assert not torch.equal(packed, feats)
    ids, feats = held["tokens"][0], held["feats"][0]
    f, _ = sequence_features(smollm_engine, ids.tolist(), smollm_engine.new_cache())
    assert torch.equal(f, feats)


def test_auto_features_resolve_to_a_forward_this_cpu_runs(smollm_engine):
    from ultrafast import kernels
    from ultrafast.bf16 import bf16_matmul_pays
    from ultrafast.training import choices_for, features_for

    assert features_for(Recipe(features="packed"), smollm_engine, bf16_fast=False) == "packed"
    assert features_for(Recipe(), smollm_engine, bf16_fast=True) == "bf16"  # a bf16 multiplier: the bf16 forward
    int8 = kernels.available() and bool(kernels.linear_path(kernels.Q4_1, 8))  # SmolLM2's types (Q4_1 among them)
    assert features_for(Recipe(), smollm_engine, bf16_fast=False) == ("int8" if int8 else "bf16")
    got, autocast = choices_for(Recipe(), smollm_engine)
    assert got in ("bf16", "int8") and (got == "int8") == (int8 and not autocast)
    assert choices_for(Recipe(bf16=False), smollm_engine)[1] is False
    if got == "int8":
        assert not bf16_matmul_pays(smollm_engine.config.dim)

"""The draft head's file: saved with the target's sha256, refused for any other file; packed for drafting."""

import pytest
import torch

from ultrafast.draft_head import DraftHeadError, file_sha256, load_head, read_head_file


def test_a_head_is_refused_for_another_model_file(tiny_head, smollm_engine, smollm_path, tmp_path):
    _, path = tiny_head
    sha = file_sha256(smollm_path)
    assert read_head_file(path)["target_sha256"] == sha
    load_head(path, smollm_engine.model, sha)  # its own file: fine
    with pytest.raises(DraftHeadError, match="trained for the model file"):
        load_head(path, smollm_engine.model, "0" * 64)
    # the same through the engine, for a copy of the model file with one byte changed
    other = tmp_path / "other.gguf"
    data = bytearray(smollm_path.read_bytes())
    data[-1] ^= 1
    other.write_bytes(bytes(data))
    from ultrafast.engine import Engine

    e = Engine.from_path(other, max_context=256)
    with pytest.raises(DraftHeadError):
        e.attach_draft_head(path)
    assert e.attach_draft_head(None) is None  # no head saved for that file
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a head")
    with pytest.raises(DraftHeadError, match="not a draft head"):
        load_head(junk, smollm_engine.model, sha)


def test_file_sha256_is_the_digest(tmp_path):
    import hashlib

    p = tmp_path / "m.gguf"
    p.write_bytes(b"x" * 100_000)
    assert file_sha256(p) == hashlib.sha256(b"x" * 100_000).hexdigest()


def test_the_packed_head_drafts_what_the_fp32_head_does(tiny_head, smollm_engine, smollm_path):
    """Packing (Q8_0 linears, the target's own LM-head rows) moves the logits a little: the argmax agrees at
    nearly every position, and the bytes read per draft token fall by at least 3x."""
    _, path = tiny_head
    sha = file_sha256(smollm_path)
    dense = load_head(path, smollm_engine.model, sha, pack=False)
    packed = load_head(path, smollm_engine.model, sha, pack=True)
    torch.manual_seed(0)
    feats = torch.randn(64, smollm_engine.config.dim) * 3
    emb = smollm_engine.model.tok_embeddings(torch.randint(0, 1000, (64,))).float()
    a = dense.logits(dense.mix(emb, feats))
    b = packed.logits(packed.mix(emb, feats))
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    assert packed.nbytes_per_token() * 3 < dense.nbytes_per_token()


def test_tokens_enter_at_unit_rms_and_older_heads_still_load(tiny_head, smollm_engine, smollm_path, tmp_path):
    """A trained head carries 1 / the RMS of the target's embedding rows and mixes the scaled token in; a head
    saved before the scale existed loads with scale 1 (what it was trained with)."""
    _, path = tiny_head
    sha = file_sha256(smollm_path)
    head = load_head(path, smollm_engine.model, sha, pack=False)
    rows = smollm_engine.model.tok_embeddings(torch.arange(0, smollm_engine.config.vocab_size, 7)).float()
    assert float(head.emb_scale) == pytest.approx(1.0 / float(rows.pow(2).mean().sqrt()), rel=0.05)
    assert float(head.emb_scale) > 5.0  # SmolLM2's rows are small (RMS ~0.13)
    blob = read_head_file(path)
    del blob["state"]["emb_scale"]
    old = tmp_path / "old.head.pt"
    torch.save(blob, old)
    older = load_head(old, smollm_engine.model, sha, pack=False)
    assert float(older.emb_scale) == 1.0
    emb, feats = rows[:4], torch.randn(4, smollm_engine.config.dim)
    assert not torch.allclose(older.mix(emb, feats), head.mix(emb, feats))
    blob["state"].pop("fc.weight")
    torch.save(blob, tmp_path / "broken.head.pt")
    with pytest.raises(DraftHeadError, match="missing"):
        load_head(tmp_path / "broken.head.pt", smollm_engine.model, sha)

"""`python -m ultrafast.benchmarks.grammar_libs [MODEL]`: xgrammar against llguidance on a model's vocabulary
(default the 1.5B's 151,936 tokens): set-up time for the vocabulary, compile time of a JSON schema, mask time per
token along a JSON document that matches it, rollback time, and whether control tokens stay out of strings.
Why `ultrafast/grammar.py` uses xgrammar. llguidance is not a dependency: `pip install llguidance` to run this."""

from __future__ import annotations

import json
import sys
import time
from importlib.metadata import version

import torch

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string"},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
DOC = {"name": "Ada Lovelace, a mathematician of London", "age": 36, "tags": ["a", "ccc", "bb"],
       "address": {"city": "London", "zip": "12345"}}


def _walk(ids, fill, accept, allowed_of):
    times = []
    for i in ids:
        t = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t)
        if not allowed_of()[i]:
            raise RuntimeError(f"the library refused token {i} of a matching document")
        if not accept(i):
            raise RuntimeError(f"the library refused to advance over token {i}")
    return 1e3 * sum(times) / len(times), 1e3 * max(times)


def main() -> int:
    from ..loader import load
    from ..pull import resolve_model

    torch.set_num_threads(2)
    loaded = load(resolve_model(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b"))
    tok, V = loaded.tokenizer, loaded.config.vocab_size
    ids = tok.encode(json.dumps(DOC), add_bos=False)
    inside_string = tok.encode('{"name": "A', add_bos=False)
    special = [i for i, t in enumerate(tok.grammar_vocab()[0]) if t == "" and i < tok.vocab_size]
    print(f"{loaded.path.name}: {V} tokens; a {len(ids)}-token JSON document; 2 threads")

    import xgrammar as xgr

    t0 = time.perf_counter()
    vocab, byte_level = tok.grammar_vocab()
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.BYTE_LEVEL if byte_level else xgr.VocabType.BYTE_FALLBACK,
                             vocab_size=V, stop_token_ids=sorted(tok.eos_ids))
    comp = xgr.GrammarCompiler(info, max_threads=2)
    t1 = time.perf_counter()
    cg = comp.compile_json_schema(json.dumps(SCHEMA), strict_mode=True)
    t2 = time.perf_counter()
    m, bm = xgr.GrammarMatcher(cg), xgr.allocate_token_bitmask(1, V)

    def xgr_allowed():
        x = torch.zeros(1, V)
        xgr.apply_token_bitmask_inplace(x, bm)
        return torch.isfinite(x[0])

    mean, worst = _walk(ids, lambda: m.fill_next_token_bitmask(bm), m.accept_token, xgr_allowed)
    t = time.perf_counter()
    m.rollback(10)
    rb = 1e3 * (time.perf_counter() - t)
    m2 = xgr.GrammarMatcher(cg)
    for i in inside_string:
        m2.accept_token(i)
    m2.fill_next_token_bitmask(bm)
    leak = int(xgr_allowed()[special].sum())
    print(f"xgrammar {version('xgrammar')}: vocabulary set-up {t1 - t0:.2f} s, schema compile {1e3 * (t2 - t1):.1f} ms, "
          f"mask {mean:.3f} ms mean / {worst:.3f} ms worst per token, rollback of 10 tokens {rb:.3f} ms, "
          f"control tokens admitted inside a string: {leak} of {len(special)}")

    try:
        import llguidance
        from llguidance.torch import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask
    except ImportError:
        print("llguidance: not installed (pip install llguidance)")
        return 0
    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(tok._backend.to_str(), n_vocab=V, eos_token=sorted(tok.eos_ids)[0])
    t1 = time.perf_counter()
    g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    lm = llguidance.LLMatcher(lt, g)
    t2 = time.perf_counter()
    lbm = allocate_token_bitmask(1, V)

    def llg_allowed():
        x = torch.zeros(1, V)
        apply_token_bitmask_inplace(x, lbm)
        return torch.isfinite(x[0])

    mean, worst = _walk(ids, lambda: fill_next_token_bitmask(lm, lbm, 0), lm.consume_token, llg_allowed)
    t = time.perf_counter()
    lm.rollback(10)
    rb = 1e3 * (time.perf_counter() - t)
    lm2 = llguidance.LLMatcher(lt, g)
    for i in inside_string:
        lm2.consume_token(i)
    fill_next_token_bitmask(lm2, lbm, 0)
    leak = int(llg_allowed()[special].sum())
    print(f"llguidance {version('llguidance')}: vocabulary set-up {t1 - t0:.2f} s, schema compile "
          f"{1e3 * (t2 - t1):.1f} ms, mask {mean:.3f} ms mean / {worst:.3f} ms worst per token, rollback of 10 "
          f"tokens {rb:.3f} ms, control tokens admitted inside a string: {leak} of {len(special)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Constrained decoding: a grammar over a request's output, as a mask of the tokens allowed next.

A `Grammar` names what the output must match: a JSON schema, any JSON value, a regular expression or an EBNF
grammar (xgrammar's dialect of GBNF). `GrammarCompiler` compiles it against the model's vocabulary with xgrammar
(chosen over llguidance by measurement: mask time and rollback on the 151,936-token Qwen vocabulary; see the
README) and caches what it compiled. A request's `Constraint` follows its output token by token.

The mask at a position is a function of the output before it, so it is part of the sampler's one rule
(`Sampler.adjusted`): the standard tier, a drafter sampling ahead and the verifier all see the same mask at the
same position, and the tiers stay token-identical under a grammar. The matcher follows whichever output it is
asked about: it rolls back to the longest prefix it shares with the output it saw last and advances from there
(a drafter walks ahead of the emitted text along a chain or a tree's branches; verification resumes from the
accepted path). Drafts the grammar refuses are cut before verification (`Constraint.cut`), and the text the
grammar forces next (a schema's keys and punctuation: xgrammar's jump-forward string), tokenized, is a free draft
(`Constraint.forced`).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

# tool_call: one call (tool_calls.py's format), tool_calls: one or more; their source is a call's JSON schema
KINDS = ("json_schema", "json_object", "regex", "ebnf", "tool_call", "tool_calls")
CACHE_GRAMMARS = 64  # compiled grammars kept per compiler


class GrammarError(ValueError):
    """A grammar the library refuses (an invalid schema, regex or EBNF), or a grammar this build cannot use."""


@dataclass(frozen=True)
class Grammar:
    kind: str  # one of KINDS
    source: str = ""  # the schema as JSON text, the regex or the EBNF; "" for json_object

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}: one of {', '.join(KINDS)}")
        if not isinstance(self.source, str):
            raise GrammarError("a grammar's source must be text")
        if self.kind != "json_object" and not self.source:
            raise GrammarError(f"a {self.kind} grammar needs its source")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> "Grammar":
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object")
        return cls("json_schema", json.dumps(schema))  # in its own key order: the output's


# in EBNF text: a string literal, a character class, or the rule name `root` (only the last is renamed)
_ROOT = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|\broot\b')


def _tool_calls(schema: str, several: bool):
    """The tags around a call matching `schema`; `several`: one or more such calls, a newline between."""
    import xgrammar as xgr

    from .tool_calls import CLOSE, OPEN

    one = xgr.Grammar.concat(xgr.Grammar.from_ebnf(f'root ::= "{OPEN}\\n"'),
                             xgr.Grammar.from_json_schema(schema, strict_mode=True, any_whitespace=False),
                             xgr.Grammar.from_ebnf(f'root ::= "\\n{CLOSE}"'))
    if not several:
        return one
    # xgrammar prints a grammar as EBNF it parses back: the one-call grammar under another root name, repeated
    rules = _ROOT.sub(lambda m: "one_tool_call" if m.group() == "root" else m.group(), str(one))
    return xgr.Grammar.from_ebnf(rules + '\nroot ::= one_tool_call ("\\n" one_tool_call)*\n')


class GrammarCompiler:
    """Compiles grammars for one tokenizer (built on first use: describing a 150k vocabulary to the library
    takes seconds), keeping the last `CACHE_GRAMMARS` compiled."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler = None
        self._cache: OrderedDict[Grammar, object] = OrderedDict()
        self._lock = threading.Lock()  # the server compiles on its event loop's threads and in its worker

    def _library(self):
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError as e:  # a dependency of the package: only a broken install lacks it
                raise GrammarError(f"constrained decoding needs xgrammar ({e})") from None
            vocab, byte_level = self.tokenizer.grammar_vocab()
            info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.BYTE_LEVEL if byte_level else
                                     xgr.VocabType.BYTE_FALLBACK, vocab_size=self.vocab_size,
                                     stop_token_ids=sorted(self.tokenizer.eos_ids))
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, grammar: Grammar):
        with self._lock:
            return self._compile(grammar)

    def _compile(self, grammar: Grammar):
        if grammar in self._cache:
            self._cache.move_to_end(grammar)
            return self._cache[grammar]
        c = self._library()
        try:
            if grammar.kind == "json_schema":
                compiled = c.compile_json_schema(grammar.source, strict_mode=True, any_whitespace=False)
            elif grammar.kind == "json_object":
                compiled = c.compile_builtin_json_grammar()
            elif grammar.kind == "regex":
                compiled = c.compile_regex(grammar.source)
            elif grammar.kind in ("tool_call", "tool_calls"):
                compiled = c.compile_grammar(_tool_calls(grammar.source, several=grammar.kind == "tool_calls"))
            else:
                compiled = c.compile_grammar(grammar.source)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"invalid {grammar.kind.replace('_', ' ')}: {_first_line(e)}") from None
        self._cache[grammar] = compiled
        if len(self._cache) > CACHE_GRAMMARS:
            self._cache.popitem(last=False)
        return compiled

    def constraint(self, grammar: Grammar) -> "Constraint":
        return Constraint(self.compile(grammar), self.vocab_size,
                          lambda text: self.tokenizer.encode(text, add_bos=False), sorted(self.tokenizer.eos_ids))


def _first_line(e: Exception) -> str:
    """The library's message without its log prefix ("[12:00:00] /project/cpp/x.cc:94: ")."""
    text = str(e).strip() or type(e).__name__
    line = text.splitlines()[-1] if "Traceback" in text else text.splitlines()[0]
    return re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", line)[:300]


class Constraint:
    """One request's matcher: which tokens may follow a given output (the tokens after the prompt)."""

    def __init__(self, compiled, vocab_size: int, encode=None, stop_ids: Sequence[int] = ()):
        import xgrammar as xgr

        self._xgr, self._compiled, self.vocab_size, self._encode = xgr, compiled, vocab_size, encode
        self._stops = torch.tensor(list(stop_ids), dtype=torch.long)
        self._matcher = xgr.GrammarMatcher(compiled)
        self._seen: list[int] = []  # the output the matcher stands after
        self._dead = False  # the output it was last asked about left the grammar (a drafter's guess)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.mask_seconds = 0.0  # time spent computing masks (the cost of constrained decoding)
        self.masks = 0

    def _goto(self, output: Sequence[int]) -> bool:
        """Stand the matcher after `output`; False if the grammar refuses it."""
        seen = self._seen
        if len(output) >= len(seen) and list(output[:len(seen)]) == seen:
            common = len(seen)  # the usual case: the output extends what the matcher saw (one C comparison)
        else:
            n = min(len(seen), len(output))
            common = 0
            while common < n and seen[common] == output[common]:
                common += 1
        if common == len(seen) == len(output) and not self._dead:
            return True
        back = len(seen) - common
        if self._dead:
            self._matcher.reset()
            self._seen, self._dead, common = [], False, 0
        elif back:
            self._matcher.rollback(back)
            del self._seen[common:]
        for tok in output[common:]:
            if not self._matcher.accept_token(int(tok)):
                self._dead = True
                return False
            self._seen.append(int(tok))
        return True

    def apply(self, logits: torch.Tensor, output: Sequence[int]) -> torch.Tensor:
        """logits [V] -> a copy with the tokens the grammar refuses after `output` at -inf. An output the grammar
        refuses (only a drafter's guess can be one: emitted tokens are always admitted) leaves logits as they
        are; the guesses after it are cut before verification anyway."""
        if not self._goto(output):
            return logits
        t = time.perf_counter()
        self._matcher.fill_next_token_bitmask(self._bitmask)
        out = logits.float().clone().reshape(1, -1)
        self._xgr.apply_token_bitmask_inplace(out, self._bitmask, vocab_size=self.vocab_size)
        if self._stops.numel() and not bool(torch.isfinite(out).any()):  # a grammar that admits nothing
            out[0, self._stops] = logits.float().reshape(-1)[self._stops]  # here (root ::= root) ends the output
        self.mask_seconds += time.perf_counter() - t
        self.masks += 1
        return out.reshape(-1)

    def cut(self, output: Sequence[int], tokens: list[int], parents: list[int] | None):
        """Drafts after `output` without those the grammar refuses: a chain (parents None) up to its first
        refused token; a tree (node i's parent parents[i-1], 0 the root) without refused nodes and their
        descendants, renumbered. Returns (tokens, parents)."""
        if parents is None:  # a chain is the tree whose node i hangs from node i - 1
            kept, _ = self.cut(output, tokens, list(range(len(tokens))))
            return kept, None
        output = list(output)
        new_index = {0: 0}
        keep_t, keep_p, paths = [], [], {0: []}
        for i, (t, p) in enumerate(zip(tokens, parents), start=1):
            if p not in new_index:
                continue
            path = paths[p] + [t]
            if not self._goto(output + path):
                continue
            keep_t.append(t)
            keep_p.append(new_index[p])
            new_index[i] = len(keep_t)
            paths[i] = path
        return keep_t, keep_p

    def forced(self, output: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` drafts for the text the grammar forces after `output` (its jump-forward string, in the
        tokenizer's own tokens), as far as the grammar admits them: drafts that are right unless the model
        splits the text into other tokens."""
        if self._encode is None or limit < 1 or not self._goto(output):
            return []
        text = self._matcher.find_jump_forward_string()
        if not text:
            return []
        toks = self._encode(text)[:limit]
        kept, _ = self.cut(output, toks, None)
        return kept


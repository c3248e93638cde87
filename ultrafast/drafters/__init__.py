"""Drafters propose the next tokens cheaply; the target model verifies them all in one pass.

Each drafter is its own module behind one small interface (`Drafter`): `begin` a request, `propose` up
to k tokens that continue the context, and `end` it. Lookups copy tokens from text seen before; drafters with
logits of their own (a draft model, self-speculation) let the request's sampler choose each draft from them
(`Sampler.draft`), as the target will choose at that position. Drafters never decide what is emitted: the verifier
accepts only what the target itself would have produced, so a bad drafter costs speed, never correctness.
"""

from __future__ import annotations

from typing import Protocol


class Drafter(Protocol):
    name: str
    # optional: cost_per_token (draft forwards, in target 1-token forwards; 0 if absent: a lookup),
    # catch_up_cost(context) (what it spends before its first draft, e.g. feeding a prompt) and, for
    # lookups, match_len (how many context tokens the last proposal matched: the policy keeps acceptance
    # per match-length class); wants_hidden (True, or the indices of further layers whose outputs follow the
    # last layer's in each row) and observe(start_pos, features, tokens_after) for a drafter that reads the
    # target's features (a draft head): the stepper hands it the rows it kept

    def begin(self, prompt_ids: list[int]) -> None:
        """A new request starts with this prompt."""

    def propose(self, context: list[int], k: int, sampler=None) -> list[int]:
        """Up to k tokens likely to follow `context` (the prompt and every token emitted so far); `sampler`, the
        request's (None: greedy choices)."""

    def end(self, context: list[int]) -> None:
        """The request is over; `context` is its prompt and full output."""


KNOWN = ("prompt_lookup", "suffix", "draft_model", "self_spec", "head", "grammar")


def parse_drafters(text: str | None) -> list[str] | None:
    """A `--drafters` option ('suffix,prompt_lookup') -> names, None if not given; unknown names are errors."""
    if not text:
        return None
    names = [d.strip() for d in text.split(",") if d.strip()]
    unknown = [d for d in names if d not in KNOWN]
    if unknown:
        raise ValueError(f"unknown drafter(s) {unknown}; known: {', '.join(KNOWN)}")
    return names


def build_drafters(names: list, *, suffix_cache=None, draft_engine=None, draft_cost: float = 0.5,
                   draft_feed_cost: float = 0.0, target=None, cache=None,
                   self_spec_cost: float = 0.75, head_cost: float = 0.05) -> list[Drafter]:
    """Drafters by name (prompt_lookup, suffix, draft_model, self_spec, head, grammar); Drafter objects pass
    through.
    self_spec needs the target engine and the request's KV cache, which it shares; head, the target engine
    with a draft head attached (`Engine.attach_draft_head`)."""
    from .draft_model import DraftModelDrafter
    from .grammar import GrammarDrafter
    from .head import HeadDrafter
    from .prompt_lookup import PromptLookupDrafter
    from .self_spec import SelfSpecDrafter
    from .suffix import SuffixCache, SuffixDrafter

    out: list[Drafter] = []
    for name in names:
        if not isinstance(name, str):  # an already-built drafter
            out.append(name)
        elif name == "prompt_lookup":
            out.append(PromptLookupDrafter())
        elif name == "grammar":
            out.append(GrammarDrafter())
        elif name == "suffix":
            out.append(SuffixDrafter(suffix_cache if suffix_cache is not None else SuffixCache()))
        elif name == "draft_model":
            if draft_engine is None:
                raise ValueError("the draft_model drafter needs a draft model (--draft-model)")
            out.append(DraftModelDrafter(draft_engine, draft_cost, draft_feed_cost))
        elif name == "self_spec":
            if target is None or cache is None:
                raise ValueError("the self_spec drafter needs the target engine and its KV cache")
            out.append(SelfSpecDrafter(target, cache, target.self_spec_layers, self_spec_cost))
        elif name == "head":
            if target is None or getattr(target, "draft_head", None) is None:
                raise ValueError("the head drafter needs a draft head (`ultrafast train-draft`, or --draft-head)")
            out.append(HeadDrafter(target, target.draft_head, head_cost or 0.05, target.max_context))
        else:
            raise ValueError(f"unknown drafter {name!r}; known: {', '.join(KNOWN)}")
    return out

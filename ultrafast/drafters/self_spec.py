"""Self-speculation: the target drafts for itself with some of its layers skipped (no extra model file).

The draft is the target's own embedding, a subset of its decoder layers (by default the middle third is
skipped, the layout that agreed best with the full model in our measurements), its final norm and head.
It shares the target's KV cache: the rows before the drafting position are the full model's, exact; the
rows the draft writes at the positions it drafts lie past the accepted tokens, where the verify pass
overwrites them before anything attends to them, as it does any rejected draft's. So it needs no cache of
its own, no prefill and no catch-up, and costs per drafted token the share of the weights it reads
(measured: `Engine.self_spec_cost`). Untrained, it agrees with the full model far less often than a draft
model does; the adaptive policy keeps it only where that pays.
"""

from __future__ import annotations

from .draft_model import DraftModelDrafter


def default_layers(n_layers: int) -> list[int]:
    """Every layer but the middle third."""
    return [i for i in range(n_layers) if not n_layers // 3 <= i < 2 * n_layers // 3]


def parse_layers(text: str, n_layers: int) -> list[int]:
    """'0-8,18-27' -> [0, ..., 8, 18, ..., 27]: ascending, within the model, at least one, not all."""
    layers = []
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            layers.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    except ValueError:
        raise ValueError(f"self-speculation layers {text!r}: expected ranges like 0-8,18-27") from None
    if not layers or any(b <= a for a, b in zip(layers, layers[1:])) or layers[0] < 0 or layers[-1] >= n_layers:
        raise ValueError(f"self-speculation layers {text!r}: need ascending, distinct layers in 0..{n_layers - 1}")
    if len(layers) == n_layers:
        raise ValueError(f"self-speculation layers {text!r}: all {n_layers} layers is the target itself, no draft")
    return layers


class SelfSpecDrafter(DraftModelDrafter):
    name = "self_spec"

    def __init__(self, engine, cache, layers: list[int], cost_per_token: float):
        super().__init__(engine, cost_per_token)
        self.cache, self.layers = cache, list(layers)

    def begin(self, prompt_ids: list[int]) -> None:
        pass

    def catch_up_cost(self, context: list[int]) -> float:
        return 0.0  # the target's cache is always in step

    def _run(self, context: list[int], k: int, pick) -> list[int]:
        """context[-1] goes at position len(context) - 1; the cache holds the full model's rows before it."""
        pos = len(context) - 1
        if k <= 0 or pos + k >= self.cache.max_len:  # the verify pass writes one row more
            return []
        history, drafts, tok = list(context), [], context[-1]
        for i in range(k):
            logits = self.engine.forward([tok], pos + i, cache=self.cache, layers=self.layers)[-1]
            tok = pick(logits, history)
            drafts.append(tok)
            history.append(tok)
        return drafts

    def end(self, context: list[int]) -> None:
        pass

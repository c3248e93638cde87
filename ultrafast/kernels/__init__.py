"""Batch-invariant CPU kernels over packed GGUF weights (a C++ torch extension, JIT-compiled on first use).

Every function here is *batch-invariant*: the result for one row (one token) is bit-identical whether it
is computed alone or inside a call with other rows, and whatever the thread count. That is what lets
speculative decoding verify k draft tokens in one call and still be provably lossless.

    qmatmul(x, w, qtype, in_features)   y = x @ dequant(w).T, w the raw GGUF bytes [out, row_bytes]
    rmsnorm(x, weight, eps)             y = x * rsqrt(mean(x^2) + eps) * weight, row-wise
    attention(q, k_cache, v_cache, start_pos, scale)   causal grouped-query attention over a KV cache
    sample_row(logits, temperature, top_k, top_p, min_p, u)   one sampled token (sampler.py's rule)
    available()                         whether the extension compiled and loaded
    multiply_peak(threads)              the multiply limit of the VNNI kernels, measured (MACs per second)
    fma_peak(threads)                   the multiply limit of the AVX2 fp32 kernels, measured (MACs per second)

Weights are dequantized to exactly the values gguf/ggml produce (fp16 scales converted to fp32, e.g.
Q4_K: (d*sc)*q - dmin*m); only the order of the fp32 sums differs from ``x @ W.T``, so results agree
with a dequantize-then-matmul reference to ~1e-6 of sum(|x|*|w|).

The extension is built with torch.utils.cpp_extension.load into $ULTRAFAST_HOME/torch_extensions
(ULTRAFAST_HOME defaults to ~/.cache/ultrafast); the first use compiles (~30 s on 2 cores, announced on
stderr) and later processes reuse the build. The kernel path is chosen at runtime (see path_in_use()):

    "vnni-int16"   CPUs with AVX512-VNNI, for Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K (the default there).
                   Activations are quantized per row and per block of 32 to int16 (s = max|x|/32639,
                   x = rint(x/s)); the file's quantized weights are multiplied with them in exact integer
                   arithmetic (x as two signed bytes, vpdpbusd), and the fp32 block scales/mins are
                   applied per block (every quantized type is read in the kernels' own layout,
                   `repack_vnni`, made at load: the same values, one fp32 step per 512 of them). The weights
                   are still exactly the file's; the int16 rounding of x
                   costs ~1e-5 (measured < 3e-5) of sum(|x|*|w|), against ~1e-6 for the fp32 path. Much cheaper per activation row, so
                   verifying k draft tokens costs little more than one. F32/F16/BF16 use the fp32 path.
    "avx512-fp32"  AVX-512 fp32 path (dequantize-in-register + FMA), ~1e-6 of sum(|x|*|w|).
    "avx2-fp32"    the same scheme in 8-lane AVX2 + FMA registers, for CPUs without AVX-512 (Zen 1-3, most
                   Intel client parts); every type.
    "avx2-int8"    with act_bits=8 where VNNI is not in use: x rounded to int8 (per super-block of 256 for Q4_K
                   and Q6_K, per block of 32 for the others) and multiplied exactly with vpmaddubsw; Q4_K and Q6_K
                   are read in the VNNI kernels' layouts (`layout_in_use`), a sub-block / scale group per int32 lane.
    "scalar"       portable path with the same math as avx512-fp32, for other CPUs.

Each path is batch-invariant on its own (bit-identical per row whatever k and the threads); the paths
are not bit-identical to each other. Environment: ULTRAFAST_KERNELS_PATH=fp32 keeps the quantized types
on the fp32 path (AVX-512, else AVX2), =avx2 on the AVX2 one even where AVX-512 exists (=scalar forces the
scalar path, =auto/vnni the default choice);
ULTRAFAST_KERNELS_SCALAR=1 also forces the scalar path. set_kernels_path() changes it at runtime.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K", "BF16", "SUPPORTED_TYPES",
    "qmatmul", "rmsnorm", "attention", "available", "load", "block_info", "row_bytes",
    "avx512_active", "vnni_supported", "linear_path", "set_force_scalar", "KernelBuildError", "decoder_block", "decoder_stack", "silu_mul", "path_in_use", "set_kernels_path",
    "multiply_peak", "MultiplyPeak", "fma_peak", "int8_madd_peak", "paired_macs", "PAIRED_LAYOUTS", "Q4_0_R16", "Q4_1_R16", "Q5_0_R16", "Q8_0_R16", "Q4_K_R2", "Q6_K_R16",
    "repack_vnni", "vnni_layout", "layout_in_use", "sample_row",
]

# GGML type ids (gguf.GGMLQuantizationType)
F32, F16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 8, 12, 14, 30

# type id -> (values per block, bytes per block)
_BLOCKS = {
    F32: (1, 4), F16: (1, 2), BF16: (1, 2),
    Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q8_0: (32, 34),
    Q4_K: (256, 144), Q6_K: (256, 210),
}
SUPPORTED_TYPES = frozenset(_BLOCKS)
# Not GGML types: the VNNI kernels' own layouts of a type's bytes (`repack_vnni`), each id its type's + 100; that
# path reads them all, the AVX2 integer one Q4_K_R2 and Q6_K_R16 (`layout_in_use`). Q4_K in pairs of super-blocks;
# the 32-value-block types 16 blocks a group; Q6_K one scale group of 16 per lane.
Q4_0_R16, Q4_1_R16, Q5_0_R16, Q8_0_R16, Q4_K_R2, Q6_K_R16 = 102, 103, 106, 108, 112, 114

_HERE = Path(__file__).resolve().parent
_SOURCES = ["qmatmul.cpp", "kernel_variant.cpp", "decoder_layer.cpp", "scalar.cpp", "qmatmul_avx512.cpp",
            "qmatmul_avx2.cpp", "qmatmul_avx2_int8.cpp", "qmatmul_vnni.cpp", "sampling.cpp"]
_HEADERS = ["kernel_variant.h", "qmatmul_kernels.h", "simd_bytes.h", "qmatmul_fp32.h", "attention_simd.h", "activation_simd.h",
            "exp_simd.h", "decoder_layer.h",
            "row_ops.h", "scratch.h"]
# No -march=native: the baseline unit must run anywhere (the AVX-512 unit enables its ISA with a
# target pragma and is only entered after a runtime CPU check), so a shared build cache stays safe.
# -ffp-contract=off: no implicit FMA contraction, so every template instantiation does the same math.
_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno"]
_LDFLAGS = ["-fopenmp"]


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded."""


_lock = threading.Lock()
_ext = None
_err: BaseException | None = None
_err_msg = ""


def block_info(qtype: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a supported GGML type."""
    try:
        return _BLOCKS[int(qtype)]
    except KeyError:
        raise ValueError(f"unsupported GGML type id {qtype}; supported: {sorted(_BLOCKS)}") from None


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one packed weight row of ``in_features`` values."""
    blk, nbytes = block_info(qtype)
    if in_features % blk:
        raise ValueError(f"in_features {in_features} is not a multiple of the block size {blk} of type {qtype}")
    return in_features // blk * nbytes


def _home() -> Path:
    return Path(os.environ.get("ULTRAFAST_HOME") or Path.home() / ".cache" / "ultrafast").expanduser()


def _build_name() -> str:
    h = hashlib.sha256()
    for f in _SOURCES + _HEADERS:
        h.update(f.encode())
        h.update((_HERE / f).read_bytes())
    h.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    return "ultrafast_kernels_" + h.hexdigest()[:12]


def _clear_stale_lock(build_dir: Path, max_age_s: float = 900.0) -> None:
    # torch's FileBaton waits forever on a lock left behind by a killed build.
    lock = build_dir / "lock"
    try:
        if lock.exists() and time.time() - lock.stat().st_mtime > max_age_s:
            lock.unlink()
    except OSError:
        pass


def load():
    """Compile (first use) and import the extension; raises KernelBuildError (a RuntimeError) on failure."""
    global _ext, _err, _err_msg
    if _ext is not None:
        return _ext
    with _lock:
        if _ext is not None:
            return _ext
        if _err is not None:
            raise KernelBuildError(_err_msg) from _err
        try:
            from torch.utils import cpp_extension

            name = _build_name()
            build_dir = _home() / "torch_extensions" / name
            build_dir.mkdir(parents=True, exist_ok=True)
            _clear_stale_lock(build_dir)
            fresh = not (build_dir / f"{name}.so").exists()
            t0 = time.perf_counter()
            if fresh:
                print(f"ultrafast: compiling C++ kernels into {build_dir} (first use, about 30 s)...",
                      file=sys.stderr, flush=True)
            ext = cpp_extension.load(
                name=name,
                sources=[str(_HERE / s) for s in _SOURCES],
                extra_cflags=list(_CFLAGS),  # copies: torch appends to these lists
                extra_ldflags=list(_LDFLAGS),
                build_directory=str(build_dir),
                verbose=False,
            )
            if fresh:
                print(f"ultrafast: kernels compiled in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
            env_path = os.environ.get("ULTRAFAST_KERNELS_PATH", "").strip().lower()
            if env_path in ("auto", "vnni", "fp32", "avx2", "avx2-fp32", "scalar"):
                ext.set_kernels_path(env_path)
            elif env_path:
                print(f"ultrafast: ignoring ULTRAFAST_KERNELS_PATH={env_path!r} (expected auto, vnni, fp32, avx2, "
                      "avx2-fp32 or scalar)", file=sys.stderr, flush=True)
            if os.environ.get("ULTRAFAST_KERNELS_SCALAR", "") not in ("", "0"):
                ext.set_force_scalar(True)
            _ext = ext
            return ext
        except Exception as e:  # compiler or ninja missing, build error, import error
            detail = str(e)
            if len(detail) > 4000:
                detail = "..." + detail[-4000:]
            _err = e
            _err_msg = (
                f"ultrafast: failed to build the C++ kernels ({type(e).__name__}). They need a C++ compiler "
                f"(g++), ninja and the torch headers; build directory: {_home() / 'torch_extensions'}.\n{detail}"
            )
            raise KernelBuildError(_err_msg) from e


def available() -> bool:
    """True when the kernels are compiled and loadable (compiles them on first call)."""
    try:
        load()
        return True
    except KernelBuildError:
        return False


def vnni_supported() -> bool:
    """Whether this CPU runs the AVX512-VNNI integer kernels and they are the path in use (8-bit activations
    need them)."""
    return available() and load().vnni_supported() and path_in_use().startswith("vnni")


def linear_path(qtype: int, act_bits: int = 16) -> str:
    """The kernels a linear of this GGML type runs on now with act_bits-bit activations ("vnni-int16", "vnni-int8",
    "avx2-int8", "avx2-int16", "avx512-fp32", "avx2-fp32", "scalar"), or "" where none multiplies that type at that width (int8
    activations need the VNNI kernels or the AVX2 integer ones)."""
    return str(load().linear_path(int(qtype), int(act_bits))) if available() else ""


def avx512_active() -> bool:
    """Whether calls use an AVX-512 path (fp32 or VNNI; False: portable scalar path)."""
    return bool(load().avx512_active())


def path_in_use() -> str:
    """The kernel path quantized types take now: "vnni-int16", "avx512-fp32", "avx2-fp32" or "scalar"."""
    return str(load().path_in_use())


def set_kernels_path(path: str) -> None:
    """Choose the kernel path, process-wide: "auto" (= "vnni": best available), "fp32" (the fp32 kernels at 16 bits:
    AVX-512, else AVX2), "avx2" (the AVX2 kernels even where AVX-512 exists: their integer ones where they take the
    type), "avx2-fp32" (the AVX2 kernels, the fp32 ones at 16 bits) or "scalar"."""
    load().set_kernels_path(str(path))


def set_force_scalar(flag: bool) -> None:
    """Force the portable scalar path (for testing); process-wide."""
    load().set_force_scalar(bool(flag))


@dataclass(frozen=True)
class MultiplyPeak:
    """The rate the multiply units sustain (12 independent vpdpbusd chains per thread, not one chain's
    latency), and what it means for the kernels: each vpdpbusd is 64 multiply-adds of an int8 activation, and
    an int16 activation takes two (its two signed bytes)."""

    threads: int
    vpdpbusd_per_s: float
    # 128-value products per second with the kernels' own arithmetic for a K-quant group of 256 values
    # (vpdpbusd in a high and a low chain, shift, add, then convert + scale multiply + fma once per two products,
    # register operands, 12 groups in flight), by activation bits: the ceiling of the numerics, below the bare
    # multiply peak where the fp32 step shares the multiply units (Zen 4)
    products_per_s: dict[int, float]
    # 512-value products per second with the arithmetic of the layouts of eight weight vectors a row (Q4_K in pairs:
    # 8 vpdpbusd, then convert, scale multiply, fma and the mins' fnmadd; int16: 16 vpdpbusd in two chains), the
    # same way: their ceiling, where the K-quant group above is Q6_K's and the file layouts'
    paired_products_per_s: dict[int, float]
    # vpdpbusd slots one fp32 FMA (or multiply) takes beside them: ~1 where they share the multiply pipes (Zen 4, whose
    # 512-bit FMAs and vpdpbusd both run on its two 256-bit multiply pipes), ~0 where they do not; with the kernels'
    # 2 fp32 multiplies per 4-8 vpdpbusd it is why products_per_s stays below the bare peak
    fma_cost: float
    # vpdpbusd slots one 64-byte load from L1 takes beside them (a vpdpbusd's x operand from memory, as the one-row
    # tile reads it: one load a vpdpbusd): 0.35-0.48 on the Intel Xeon, ~0 where loads do not bind. The arithmetic
    # ceilings above take register operands, so where this is large the kernels' loads hold them further below it
    load_cost: float

    def arithmetic_macs_per_s(self, act_bits: int, paired_share: float = 0.0) -> float:
        """Multiply-adds per second at the kernels' arithmetic for a model whose `paired_share` of multiply-adds run
        on the paired layouts (`paired_macs`), the rest as K-quant groups: the time of each share at its rate."""
        if act_bits not in (8, 16):
            raise ValueError(f"act_bits must be 16 or 8, got {act_bits!r}")
        if not 0.0 <= paired_share <= 1.0:
            raise ValueError(f"paired_share must be in [0, 1], got {paired_share!r}")
        kquant, paired = 128.0 * self.products_per_s[act_bits], 512.0 * self.paired_products_per_s[act_bits]
        return 1.0 / ((1.0 - paired_share) / kquant + paired_share / paired)

    @property
    def int8_macs_per_s(self) -> float:
        return 64.0 * self.vpdpbusd_per_s

    @property
    def int16_macs_per_s(self) -> float:
        return 32.0 * self.vpdpbusd_per_s

    def macs_per_s(self, act_bits: int) -> float:
        if act_bits not in (8, 16):
            raise ValueError(f"act_bits must be 16 or 8, got {act_bits!r}")
        return self.int8_macs_per_s if act_bits == 8 else self.int16_macs_per_s


def multiply_peak(threads: int | None = None, iters: int = 10_000_000, reps: int = 3) -> MultiplyPeak | None:
    """Measure the VNNI multiply limit on `threads` threads together (default: torch's thread count), best of
    `reps` runs of 12 x `iters` vpdpbusd per thread (~0.1 s each). None where the VNNI kernels do not run."""
    threads = torch.get_num_threads() if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    ext = _ext_or_load()
    rate = float(ext.vnni_multiply_peak(threads, int(iters), int(reps)))
    if rate <= 0:
        return None
    # a product is 6-10 instructions where a chain step is one: a tenth of the iterations takes as long
    products = {bits: float(ext.vnni_product_peak(threads, max(1, int(iters) // 10), int(reps), bits)) for bits in (16, 8)}
    paired = {bits: float(ext.vnni_paired_peak(threads, max(1, int(iters) // 20), int(reps), bits)) for bits in (16, 8)}
    fma_cost = float(ext.vnni_fma_cost(threads, max(1, int(iters) // 4), int(reps)))
    load_cost = float(ext.vnni_load_cost(threads, max(1, int(iters) // 4), int(reps)))
    return MultiplyPeak(threads, rate, products, paired, fma_cost, load_cost)


PAIRED_LAYOUTS = frozenset({Q4_0_R16, Q4_1_R16, Q5_0_R16, Q8_0_R16, Q4_K_R2})  # eight weight vectors a row and group


def paired_macs(model) -> int:
    """Multiply-adds per token of the model's packed linears that the VNNI kernels run on the paired layouts
    (PAIRED_LAYOUTS: one fp32 step per 512 values), its LM head included."""
    return sum(m.in_features * m.out_features for m in model.modules()
               if isinstance(getattr(m, "qtype", None), int) and hasattr(m, "in_features") and hasattr(m, "out_features")
               and vnni_layout(m.qtype) in PAIRED_LAYOUTS)


def fma_peak(threads: int | None = None, iters: int = 10_000_000, reps: int = 3) -> float | None:
    """Measure the multiply limit of the AVX2 fp32 kernels on `threads` threads together (default: torch's
    thread count): fp32 multiply-adds per second, best of `reps` runs of 12 independent 8-lane FMA chains of
    `iters` steps per thread (the rate of the units, not one chain's latency). None without AVX2."""
    threads = torch.get_num_threads() if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    rate = float(_ext_or_load().avx2_fma_peak(threads, int(iters), int(reps)))
    return 8.0 * rate if rate > 0 else None


def int8_madd_peak(threads: int | None = None, iters: int = 10_000_000, reps: int = 3) -> float | None:
    """Measure the multiply limit of the AVX2 integer kernels (`avx2-int8`) on `threads` threads together (default:
    torch's thread count): int8 multiply-adds per second, best of `reps` runs of 6 independent chains of the lanes'
    arithmetic (vpmaddubsw, its int16 pairs summed by vpaddw, a vpmaddwd by the scales and a vpaddd per 8 of them),
    32 multiply-adds a vpmaddubsw, 12 * `iters` of them per thread. None without AVX2."""
    threads = torch.get_num_threads() if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    rate = float(_ext_or_load().avx2_madd_peak(threads, int(iters), int(reps)))
    return 32.0 * rate if rate > 0 else None


def _ext_or_load():
    return _ext if _ext is not None else load()


def _not_tensor(name: str, t) -> ValueError:
    return ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def qmatmul(x: torch.Tensor, w: torch.Tensor, qtype: int, in_features: int, act_bits: int = 16) -> torch.Tensor:
    """y[k, out] = x[k, in] @ dequant(w).T with w the raw GGUF bytes, uint8 [out_features, row_bytes].

    x may also be [in] or [..., in] (leading dims are flattened into rows and restored). Batch-invariant:
    each row's result is bit-identical whatever the other rows and the thread count. Wrong dtypes or
    shapes raise ValueError (checked in C++). act_bits: x is rounded per block of 32 to int16 (default) or
    int8 inside the VNNI kernels (int8 needs them: ValueError on another path for a quantized type).
    """
    ext = _ext_or_load()
    try:
        nd = x.dim()
    except AttributeError:
        raise _not_tensor("x", x) from None
    if not isinstance(w, torch.Tensor):
        raise _not_tensor("w", w)
    if nd == 2:
        return ext.qmatmul(x, w, qtype, in_features, act_bits)
    if nd == 0:
        raise ValueError("x must be [k, in_features], got a scalar")
    y = ext.qmatmul(x.reshape(-1, x.shape[-1]), w, qtype, in_features, act_bits)
    return y.view(*x.shape[:-1], y.shape[1])


def vnni_layout(qtype: int) -> int | None:
    """The type id of the VNNI kernels' own layout of `qtype` (`repack_vnni`), or None where they read the file's."""
    layout = _ext_or_load().vnni_layout(int(qtype))
    return None if layout < 0 else layout


def layout_in_use(qtype: int, act_bits: int = 16) -> int | None:
    """The type id of the layout made at load (`repack_vnni`) that the kernels in force read for a linear of `qtype`
    with act_bits-bit activations, or None where they read the file's bytes: every quantized type's on the VNNI
    kernels, Q4_K's and Q6_K's on the AVX2 integer ones (int8 activations)."""
    if not available():
        return None
    layout = load().layout_in_use(int(qtype), int(act_bits))
    return None if layout < 0 else layout


def repack_vnni(w: torch.Tensor, qtype: int, in_features: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of `qtype` (uint8 [rows, row_bytes]) laid out for the VNNI kernels, type id `vnni_layout(qtype)`: the same
    values and bytes per row, so that one fp32 step covers 512 values and the weights need no permute (see
    qmatmul_vnni.cpp: KQ4K2 holds Q4_K's pairs of super-blocks, KB16 sixteen blocks of 32 of the other types, one
    a lane). A new tensor; the rows' outputs differ from the file's layout only in the order of the fp32 adds.
    out: written in place of a new tensor (contiguous uint8 of w's shape, apart from w), and returned.
    ValueError for a type without such a layout or bytes that do not hold the rows."""
    if not isinstance(w, torch.Tensor):
        raise _not_tensor("w", w)
    if out is not None and not isinstance(out, torch.Tensor):
        raise _not_tensor("out", out)
    return _ext_or_load().repack_vnni(w, int(qtype), int(in_features), out)


def sample_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, u: float) -> int:
    """One token from one row of logits (float32 [V], CPU) by sampler.py's rule: temperature, top-k, top-p and min-p
    truncation, then the inverse CDF at u in [0, 1) in vocabulary order (sampling.cpp; ~0.1-0.2 ms on a 152k
    vocabulary where the PyTorch ops take ~1 ms). ValueError for other rows or parameters out of range."""
    if not isinstance(logits, torch.Tensor):
        raise _not_tensor("logits", logits)
    return _ext_or_load().sample_row(logits, float(temperature), int(top_k), float(top_p), float(min_p), float(u))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Row-wise RMSNorm of x [k, d] (or [d], [..., d]): x * rsqrt(mean(x^2) + eps) * weight, fp32.

    Fixed reduction order per row, so batch-invariant.
    """
    ext = _ext_or_load()
    try:
        nd = x.dim()
    except AttributeError:
        raise _not_tensor("x", x) from None
    if not isinstance(weight, torch.Tensor):
        raise _not_tensor("weight", weight)
    if nd == 2:
        return ext.rmsnorm(x, weight, eps)
    if nd == 0:
        raise ValueError("x must be [k, d], got a scalar")
    return ext.rmsnorm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up elementwise, fp32, with the op the fused decoder layer uses under the path in force.

    Each element's result depends only on its own gate and up values (batch-invariant).
    """
    ext = _ext_or_load()
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise _not_tensor(name, t)
    return ext.silu_mul(gate, up)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start_pos: int,
              scale: float, tree=None) -> torch.Tensor:
    """Causal grouped-query attention for k new tokens at positions start_pos .. start_pos+k-1.

    q: [k, n_heads, head_dim]; k_cache, v_cache: [n_kv_heads, max_len, head_dim] already holding positions
    0 .. start_pos+k-1. Head h reads kv head h // (n_heads // n_kv_heads); query i sees positions
    <= start_pos+i. Returns [k, n_heads, head_dim] fp32, bit-identical per query whatever k.
    tree: a token tree's key lists (`TreeLayout.kernel_args`): query i then sees the rows its node's path
    lists instead, with the same bits as if that path had been fed one token at a time.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise _not_tensor(name, t)
    keys, extra = tree if tree is not None else (None, None)
    return _ext_or_load().attention(q, k_cache, v_cache, start_pos, scale, keys, extra)


def decoder_block(x, starts, lens, attn_norm, ffn_norm, eps: float, weights, qtypes, biases, k_caches, v_caches,
                  cos, sin, n_heads: int, n_kv_heads: int, head_dim: int, scale: float,
                  act_bits: int = 16, tree=None, part: int = 0, share=None) -> torch.Tensor:
    """One whole decoder layer in one call (see qmatmul.cpp): returns the new residual stream [T, d].

    The T rows are segments of one or more sequences: lens[s] rows at positions starts[s].., whose new keys
    and values go into k_caches[s]/v_caches[s] [n_kv_heads, max_len, head_dim]. weights/qtypes: the raw GGUF
    rows and type ids of wq, wk, wv, wo, w1 (gate), w3 (up), w2 (down); biases: [] or [bq, bk, bv];
    cos/sin: [T, head_dim] RoPE rows of the rows' positions. Batch-invariant like the rest.
    tree: a token tree's key lists for one sequence (`TreeLayout.kernel_args`, see `attention`).
    part (tensor parallelism's all-reduce points): 1 runs the attention half and returns wo's output, 2 runs the
    feed-forward half on x and returns down's output (each this rank's partial sum; x is not changed).
    share: per sequence s, None or (j, m): sequence j's caches hold the same first m rows as s's (its sibling
    best-of-n candidate, the prompt), m at most both starts; attention then reads them from j's for both (once for
    the batch). The same bits either way."""
    keys, extra = tree if tree is not None else (None, None)
    return _ext_or_load().decoder_block(x, list(starts), list(lens), attn_norm, ffn_norm, eps, list(weights),
                                        list(qtypes), list(biases), list(k_caches), list(v_caches), cos, sin,
                                        n_heads, n_kv_heads, head_dim, scale, act_bits, keys, extra, part,
                                        _share_pairs(share, len(starts)))


def _share_pairs(share, n_seq: int) -> list[int]:
    """`share` (None, or per sequence None or (source sequence, rows)) as the kernels' flat list."""
    if share is None:
        return []
    if len(share) != n_seq:
        raise ValueError(f"share needs one entry per sequence ({n_seq}), got {len(share)}")
    out = []
    for s in share:
        j, m = (-1, 0) if s is None else s
        out += [int(j), int(m)]
    return out


def decoder_stack(x, starts, lens, attn_norms, ffn_norms, eps: float, weights, qtypes, biases, k_caches, v_caches,
                  cos, sin, n_heads: int, n_kv_heads: int, head_dim: int, scale: float, act_bits: int = 16,
                  tree=None, keep=(), share=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Several decoder layers in one call, in the order given: `decoder_block` for each on the residual stream,
    without a Python->C++ crossing per layer (the same arithmetic, so the same bits). Per layer l: attn_norms[l],
    ffn_norms[l]; its 7 linears at weights/qtypes[7l:7l + 7]; biases[3l:3l + 3] (or no biases at all); its caches
    at k_caches/v_caches[l * n_seq:(l + 1) * n_seq], one per sequence. keep: positions in that order after which
    the stream is also returned. share: as `decoder_block`'s, for every layer. Returns (x after the last layer,
    [x after each kept position])."""
    keys, extra = tree if tree is not None else (None, None)
    return _ext_or_load().decoder_stack(x, list(starts), list(lens), list(attn_norms), list(ffn_norms), eps,
                                        list(weights), list(qtypes), list(biases), list(k_caches), list(v_caches),
                                        cos, sin, n_heads, n_kv_heads, head_dim, scale, act_bits, keys, extra,
                                        list(keep), _share_pairs(share, len(starts)))

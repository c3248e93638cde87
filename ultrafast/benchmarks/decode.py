"""`ultrafast bench`: batch-1 decode against the memory wall, and against llama.cpp in the same run.

Every speed comes with the bytes of weights read per token, the achieved GB/s and the % of the roofline
(the machine's read bandwidth, measured in the same run with 1 and with all threads). r(k) is the cost of
a k-token forward relative to a 1-token forward at the same position: what speculative decoding pays to
verify k tokens at once. The multiply limit is measured in the same run too (12 independent vpdpbusd chains
per thread: the units' rate, not one chain's latency), and beside r(k) and prefill come the % of that peak
the kernels reach and the physical r(k): a k-row forward can take no less than the longer of streaming the
weights once at the measured bandwidth and k rows of multiplies at the measured peak. Where
llama-cpp-python is installed, the same model, prompt tokens and thread count run through llama.cpp and the
ratios are printed.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from .. import report
from ..report import Progress

# Fixed prompt material (code, as the coder models see it), cut or repeated to the requested length.
PROMPT_TEXT = '''import heapq
from dataclasses import dataclass, field


@dataclass(order=True)
class Job:
    priority: int
    name: str = field(compare=False)
    retries: int = field(default=0, compare=False)


class Scheduler:
    """A priority queue of jobs with bounded retries."""

    def __init__(self, max_retries: int = 3):
        self.queue: list[Job] = []
        self.max_retries = max_retries
        self.done: list[str] = []

    def submit(self, job: Job) -> None:
        heapq.heappush(self.queue, job)

    def run_once(self, runner) -> bool:
        if not self.queue:
            return False
        job = heapq.heappop(self.queue)
        try:
            runner(job)
            self.done.append(job.name)
        except Exception:
            if job.retries < self.max_retries:
                job.retries += 1
                self.submit(job)
        return True
'''


def measure_read_bandwidth(threads: int, gib: float = 1.0, reps: int = 5) -> float:
    """Best-of-reps GB/s of torch.sum over a large fp32 buffer with `threads` threads."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(int(gib * (1 << 30)) // 4)
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        return x.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(prev)


def prompt_tokens(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(PROMPT_TEXT, add_bos=False)
    return (ids * (n // len(ids) + 1))[:n]


@dataclass
class RunFigures:
    engine: str
    prefill_tokens_per_s: float
    ttft_s: float
    decode_tokens_per_s: float
    r_k: dict = field(default_factory=dict)
    forward_s: dict = field(default_factory=dict)  # k -> seconds of a k-row forward (ours only)


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_ours(engine, ids: list[int], gen: int, max_k: int, reps: int) -> RunFigures:
    from ..sampler import SamplingParams
    from ..speculative import forward_times

    engine.generate(ids[:16], SamplingParams(max_tokens=8, ignore_eos=True))  # warm up
    res = engine.generate(ids, SamplingParams(max_tokens=gen, ignore_eos=True))
    probe = (res.token_ids + ids)[:max_k + 1]  # the model's own continuation of the prompt, as drafts would be
    t = forward_times(engine, max_k, reps, prefix=ids, probe=probe, cache=engine.cache)
    r_k = {k: t[k] / t[1] for k in range(1, max_k + 1)}
    return RunFigures("ultrafast", res.prefill_tokens_per_s, res.ttft_s, res.decode_tokens_per_s, r_k,
                      {k: t[k] for k in range(1, max_k + 1)})


def bench_llama_cpp(path, ids: list[int], gen: int, threads: int, max_k: int, reps: int) -> RunFigures | None:
    try:
        import numpy as np
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(path), n_ctx=len(ids) + gen + max_k + 8, n_threads=threads,
                n_threads_batch=threads, n_batch=512, verbose=False)
    llm.eval(ids[:16])  # warm up
    llm.n_tokens = 0
    t0 = time.perf_counter()
    llm.eval(ids)
    ttft = time.perf_counter() - t0

    def last_token() -> int:
        # llama-cpp-python 0.3.x keeps `scores` only with logits_all (which would make its prefill compute the
        # head for every prompt row); the context holds the last row's logits either way
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
        return int(np.argmax(logits))
    tok = last_token()
    out = [tok]
    t1 = time.perf_counter()
    for _ in range(gen - 1):
        llm.eval([tok])
        tok = last_token()
        out.append(tok)
    decode = (gen - 1) / (time.perf_counter() - t1)
    n = len(ids)
    probe = (out + ids)[:max_k]
    r_k, t1k = {}, None

    def run(k):
        llm.n_tokens = n
        llm.eval(probe[:k])
    for k in range(1, max_k + 1):
        t = _median_time(lambda: run(k), reps)
        t1k = t1k or t
        r_k[k] = t / t1k
    return RunFigures("llama.cpp", n / ttft, ttft, decode, r_k)


def run_bench(model: str, *, prompt_len: int = 128, gen: int = 256, threads: int = 2, max_k: int = 16,
              reps: int = 5, llama_cpp: bool = True, max_context: int | None = None, activation_bits: int = 16,
              progress=sys.stderr) -> dict:
    from .. import kernels
    from ..engine import Engine
    from ..pull import resolve_model

    torch.set_num_threads(threads)
    path = resolve_model(model)
    bar = Progress(5 if llama_cpp else 4, "bench", "phase", file=progress)
    bar.note(f"loading {path.name}")
    engine = Engine.from_path(path, max_context=max_context or max(prompt_len + gen + max_k + 8, 1024),
                              activation_bits=activation_bits)
    info = engine.describe()
    bar.update(1)
    bar.note("read bandwidth, 1 and all threads")
    bw1 = measure_read_bandwidth(1)
    bwn = measure_read_bandwidth(threads)
    macs = engine.model.macs_per_token()
    macs_prefill = engine.model.macs_per_token(head=False)
    # the share of the multiply-adds on the paired layouts, whose arithmetic has its own ceiling (VNNI path)
    paired_share = kernels.paired_macs(engine.model) / macs if macs and "vnni" in info["kernels"] else 0.0
    bar.update(1)
    bar.note("the multiply peak")
    peak = kernels.multiply_peak(threads) if "vnni" in info["kernels"] else None
    # the AVX2 kernels' limits: fp32 FMAs, or (avx2-int8, avx2-int16) vpmaddubsw summed by vpaddw, one per int8
    # multiply-add, two per int16 one (a byte plane each)
    fma = kernels.fma_peak(threads) if "avx2-fp32" in info["kernels"] else None
    int16 = "avx2-int16" in info["kernels"]
    madd = kernels.int8_madd_peak(threads) if "avx2-int8" in info["kernels"] or int16 else None
    bar.update(1)
    ids = prompt_tokens(engine.tokenizer, prompt_len)
    bar.note(f"ours: prefill {prompt_len}, decode {gen}, r(k) for k = 1..{max_k}")
    ours = bench_ours(engine, ids, gen, max_k, reps)
    bar.update(1)
    del engine
    if llama_cpp:
        bar.note("llama.cpp: the same")
    theirs = bench_llama_cpp(path, ids, gen, threads, max_k, reps) if llama_cpp else None
    bar.close()
    bpt = info["weight_bytes_per_token"]
    roofline = bwn * 1e9 / bpt
    multiply = None
    if peak is not None or fma is not None or madd is not None:
        # the VNNI kernels' int16/int8 multiply-adds, or the AVX2 kernels' fp32 or int8 ones
        rate = peak.macs_per_s(activation_bits) if peak is not None else fma or (madd / 2 if int16 else madd)
        arith = peak.arithmetic_macs_per_s(activation_bits, paired_share) if peak is not None else None
        t_mem = bpt / (bwn * 1e9)

        def physical(k: int, r: float = rate) -> float:  # the longer of one pass over the weights and k rows of multiplies
            return max(t_mem, k * macs / r)
        multiply = {
            "vpdpbusd_per_s": peak.vpdpbusd_per_s if peak is not None else None,
            "fma_per_s": fma / 8 if fma is not None else None,
            "vpmaddubsw_per_s": madd / 32 if madd is not None else None,
            "activation_bits": 32 if fma is not None else activation_bits, "macs_per_s": rate,
            "macs_per_token": macs, "macs_per_token_prefill": macs_prefill,
            "physical_r_k": {k: physical(k) / physical(1) for k in ours.r_k},
            "arithmetic_macs_per_s": arith,
            "paired_share": paired_share if peak is not None else None,
            "fma_cost_in_vpdpbusd": peak.fma_cost if peak is not None else None,
            "load_cost_in_vpdpbusd": peak.load_cost if peak is not None else None,
            "arithmetic_r_k": {k: physical(k, arith) / physical(1, arith) for k in ours.r_k} if arith else None,
            "pct_of_peak_k": {k: 100 * k * macs / ours.forward_s[k] / rate for k in ours.r_k},
            "pct_of_peak_prefill": 100 * ours.prefill_tokens_per_s * macs_prefill / rate,
            "prefill_limit_tokens_per_s": rate / macs_prefill,
        }

    def summary(f: RunFigures | None):
        if f is None:
            return None
        gbs = f.decode_tokens_per_s * bpt / 1e9
        return {**asdict(f), "ttft_ms": f.ttft_s * 1000, "achieved_gb_per_s": gbs, "pct_of_roofline": 100 * gbs / bwn}

    return {
        "model": str(path.name), "prompt_tokens": prompt_len, "gen_tokens": gen, "threads": threads,
        "weight_bytes_per_token": bpt, "weight_bytes_held": info["weight_bytes_held"],
        "weight_bytes_layout": info["weight_bytes_layout"], "weight_bytes_in_file": info["weight_bytes_in_file"],
        "file_tensor_bytes": info["file_tensor_bytes"], "kernels": info["kernels"],
        "read_gb_per_s_1_thread": bw1, f"read_gb_per_s_{threads}_threads": bwn,
        "roofline_tokens_per_s": roofline, "multiply_peak": multiply,
        "ultrafast": summary(ours), "llama_cpp": summary(theirs),
        "decode_ratio_vs_llama_cpp": (ours.decode_tokens_per_s / theirs.decode_tokens_per_s) if theirs else None,
    }


def acceptance_needed(r_k: dict, speedup: float, draft_cost: float = 0.0) -> tuple[int, float] | None:
    """The lowest acceptance per draft at which a chain of k drafts, each accepted with that probability given the ones
    before, reaches `speedup` over plain steps at these verify costs: tokens per pass (1 + a + ... + a^k) over the
    pass's cost r(k + 1) + k * draft_cost (draft_cost in steps), the best k. (k, a), or None where no chain can (even
    every draft accepted). What the tier's drafts must reach on a machine, whatever drafts them."""
    if speedup <= 0 or draft_cost < 0:
        raise ValueError(f"speedup must be > 0 and draft_cost >= 0, got {speedup!r}, {draft_cost!r}")
    r = {int(k): float(v) for k, v in r_k.items()}
    best = None
    for k in sorted(r):
        if k + 1 not in r:
            continue
        cost = r[k + 1] + k * draft_cost

        def gain(a: float) -> float:
            return sum(a ** i for i in range(k + 1)) / cost
        if gain(1.0) < speedup:
            continue
        lo, hi = 0.0, 1.0
        for _ in range(50):  # gain rises with a
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if gain(mid) < speedup else (lo, mid)
        if best is None or hi < best[1]:
            best = (k, hi)
    return best


def format_table(r: dict) -> str:
    us, lc = r["ultrafast"], r["llama_cpp"]
    t = r["threads"]
    lines = [
        f"model {r['model']}: {r['prompt_tokens']}-token prompt, {r['gen_tokens']} generated, {t} threads, "
        f"kernels: {r['kernels']}",
        f"weights read per token {r['weight_bytes_per_token'] / 1e6:.1f} MB (in memory {r['weight_bytes_held'] / 1e6:.1f} MB, "
        f"{r.get('weight_bytes_layout', 0) / 1e6:.1f} MB of them the kernels' layouts, "
        f"{r.get('weight_bytes_in_file', 0) / 1e6:.1f} MB more read from the file's mapping, "
        f"for {r['file_tensor_bytes'] / 1e6:.1f} MB in the file); read bandwidth {r['read_gb_per_s_1_thread']:.1f} GB/s "
        f"(1 thread), {r[f'read_gb_per_s_{t}_threads']:.1f} GB/s ({t}); roofline {r['roofline_tokens_per_s']:.0f} tok/s",
        "",
        f"{'':24}{'ultrafast':>12}{'llama.cpp':>12}{'ratio':>8}",
    ]

    def row(label, key, fmt):
        a = us[key]
        b = lc[key] if lc else None
        ratio = f"{a / b:8.2f}" if b else f"{'':8}"
        lines.append(f"{label:24}{fmt.format(a):>12}{(fmt.format(b) if b is not None else '-'):>12}{ratio}")
    row("decode tok/s", "decode_tokens_per_s", "{:.1f}")
    row("achieved GB/s", "achieved_gb_per_s", "{:.1f}")
    row("% of roofline", "pct_of_roofline", "{:.0f}%")
    row("prefill tok/s", "prefill_tokens_per_s", "{:.0f}")
    row("TTFT ms", "ttft_ms", "{:.0f}")
    mp = r.get("multiply_peak")
    if mp:
        lines.append(f"{'prefill % of mult. peak':24}{mp['pct_of_peak_prefill']:>11.0f}%"
                     f"   (limit {mp['prefill_limit_tokens_per_s']:.0f} tok/s)")
        lines.append("")
        if mp["vpdpbusd_per_s"]:
            lines.append(f"multiply peak (measured, {t} threads): {mp['vpdpbusd_per_s'] / 1e9:.2f} G vpdpbusd/s = "
                         f"{mp['macs_per_s'] / 1e9:.0f} G int{mp['activation_bits']} MAC/s; "
                         f"{mp['macs_per_token'] / 1e9:.2f} G MACs per token")
        elif mp.get("vpmaddubsw_per_s") or mp["activation_bits"] == 8:  # avx2-int8, avx2-int16
            per = mp.get("vpmaddubsw_per_s") or mp["macs_per_s"] / 32
            two = ", two per int16 MAC (one a byte plane of x)" if mp["activation_bits"] == 16 else ""
            lines.append(f"multiply peak (measured, {t} threads): {per / 1e9:.2f} G vpmaddubsw/s "
                         f"(summed by vpaddw, a vpmaddwd per 8{two}) = {mp['macs_per_s'] / 1e9:.0f} G "
                         f"int{mp['activation_bits']} MAC/s; {mp['macs_per_token'] / 1e9:.2f} G MACs per token")
        else:
            lines.append(f"multiply peak (measured, {t} threads): {mp['fma_per_s'] / 1e9:.2f} G 8-lane FMA/s = "
                         f"{mp['macs_per_s'] / 1e9:.0f} G fp32 MAC/s; {mp['macs_per_token'] / 1e9:.2f} G MACs per token")
        if mp["arithmetic_macs_per_s"]:
            paired = f", {100 * mp['paired_share']:.0f}% of the MACs in the paired layouts" if mp.get("paired_share") else ""
            lines.append(f"the kernels' arithmetic alone (their instructions per product, register operands, no weight "
                         f"decode{paired}): {mp['arithmetic_macs_per_s'] / 1e9:.0f} G MAC/s = "
                         f"{100 * mp['arithmetic_macs_per_s'] / mp['macs_per_s']:.0f}% of the peak")
        if mp.get("fma_cost_in_vpdpbusd") is not None:
            lines.append(f"an fp32 FMA beside vpdpbusd takes {mp['fma_cost_in_vpdpbusd']:.2f} of a vpdpbusd's slot "
                         f"(1: they share the multiply pipes; the kernels' fp32 step is a scale multiply and an fma per "
                         f"4-8 vpdpbusd)")
        if mp.get("load_cost_in_vpdpbusd") is not None:
            lines.append(f"a 64-byte load from L1 beside vpdpbusd takes {mp['load_cost_in_vpdpbusd']:.2f} of a vpdpbusd's "
                         f"slot (the one-row tile loads an x vector for each vpdpbusd; the arithmetic above has register "
                         f"operands)")
    lines.append("")
    ks = sorted(us["r_k"], key=int)
    lines.append("r(k) = time(k-token forward) / time(1-token forward)")
    lines.append("k          " + "".join(f"{k:>6}" for k in ks))
    lines.append("ultrafast  " + "".join(f"{us['r_k'][k]:6.2f}" for k in ks))
    if mp:
        lines.append("physical   " + "".join(f"{mp['physical_r_k'][k]:6.2f}" for k in ks)
                     + "   max(weight stream, k rows of multiplies at peak)")
        if mp["arithmetic_r_k"]:
            lines.append("arithmetic " + "".join(f"{mp['arithmetic_r_k'][k]:6.2f}" for k in ks)
                         + "   the same with the kernels' arithmetic at its full rate")
        lines.append("% of peak  " + "".join(f"{mp['pct_of_peak_k'][k]:5.0f}%" for k in ks)
                     + "   multiplies done / time, against the peak")
    if lc:
        lines.append("llama.cpp  " + "".join(f"{lc['r_k'][k]:6.2f}" for k in ks))

    def needed(r_k: dict) -> str:
        out = []
        for s in (1.5, 2.0, 3.0):
            a = acceptance_needed(r_k, s)
            out.append(f"{s:g}x: {a[1]:.2f} (k = {a[0]})" if a else f"{s:g}x: none can")
        return ", ".join(out)
    lines.append(f"acceptance per draft a chain of k drafts needs, drafting free, at these r(k): {needed(us['r_k'])}")
    if mp:
        lines.append(f"{'':>42}at the physical r(k): {needed(mp['physical_r_k'])}")
    return "\n".join(lines)


def main(args) -> int:
    r = run_bench(args.model, prompt_len=args.prompt_tokens, gen=args.gen_tokens, threads=args.threads,
                  max_k=args.max_k, llama_cpp=not args.no_llama_cpp, activation_bits=args.activation_bits)
    print(format_table(r))
    report.write(args.json, r, lambda png: plot(r, png))
    return 0


def plot(r: dict, path) -> None:
    """Left: r(k), ours against the physical r(k) (and the kernels' arithmetic, and llama.cpp's). Right: decode
    tokens/s, ours and llama.cpp's, under the memory roofline."""
    us, lc, mp = r["ultrafast"], r["llama_cpp"], r.get("multiply_peak")
    ks = sorted(us["r_k"], key=int)
    with report.figure(path, ncols=2, size=(10.0, 4.2)) as (fig, (ax, bx)):
        ax.plot([int(k) for k in ks], [us["r_k"][k] for k in ks], "o-", label="ours (measured)",
                color=report.TIER_COLOURS["ultrafast"])
        if mp:
            ax.plot([int(k) for k in ks], [mp["physical_r_k"][k] for k in ks], "--", color="black",
                    label="physical: max(weights once, k rows at the multiply peak)")
            if mp["arithmetic_r_k"]:
                ax.plot([int(k) for k in ks], [mp["arithmetic_r_k"][k] for k in ks], ":", color="tab:green",
                        label="the kernels' arithmetic at full rate")
        if lc:
            ax.plot([int(k) for k in ks], [lc["r_k"][k] for k in ks], "s-", color=report.TIER_COLOURS["llama.cpp"],
                    label="llama.cpp (measured)", markersize=4)
        ax.set_xlabel("k (rows in one forward)")
        ax.set_ylabel("r(k) = time(k rows) / time(1 row)")
        ax.set_title(f"Verifying k tokens at once: {r['model']}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        names = ["ours"] + (["llama.cpp"] if lc else [])
        vals = [us["decode_tokens_per_s"]] + ([lc["decode_tokens_per_s"]] if lc else [])
        bx.bar(names, vals, color=[report.TIER_COLOURS["ultrafast"]] + ([report.TIER_COLOURS["llama.cpp"]] if lc else []))
        bx.axhline(r["roofline_tokens_per_s"], color="black", linestyle="--",
                   label=f"memory roofline {r['roofline_tokens_per_s']:.0f} tok/s")
        for i, v in enumerate(vals):
            bx.annotate(f"{v:.1f}", (i, v), ha="center", va="bottom", fontsize=8)
        bx.set_ylabel("batch-1 decode tokens/s")
        bx.set_title(f"Plain decode (standard tier), {r['threads']} threads", fontsize=9)
        bx.legend(fontsize=7)
        bx.grid(axis="y", alpha=0.3)

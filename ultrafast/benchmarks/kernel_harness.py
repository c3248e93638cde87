"""A 1-thread harness over the VNNI kernels' unit, for the questions a model's timings cannot answer: where a k-row
product's time goes, and what other tiles or the AMX tile multiplies would give, every variant's bits compared with
the engine's.

    python -m ultrafast.benchmarks.kernel_harness tiles|amx|lanes|mix [--rows 512] [--cols 1536] [--ks 1,4,10,16]
                                                  [--reps 200]

`harness/vnni_tiles.cpp` includes `ultrafast/kernels/qmatmul_vnni.cpp` whole (the code the engine runs) and is built
here with g++ (the kernels' flags, the AVX-512 instructions enabled for the harness's own loops) into
$ULTRAFAST_HOME/harness. On a random Q4_K matrix of --rows x --cols repacked as the engine repacks it, int8 activations,
microseconds per call, best of --reps (the matrix stays in L2):
- `tiles`: the engine's schedule against forced tiles (1 x 16; 2 x 4, 2 x 5, 2 x 6, which load each x vector once for
  two weight rows, chunks of activation rows; 2 x k, all of them in one sweep with the accumulators spilled);
- `amx`: an AMX prototype (tile multiplies per 16 weight rows and block of 32, the fp32 step on vectors over weight
  rows; see the source) with its scales computed per call and precomputed, and without its tile instructions; then
  a unit's tile instructions alone and its tile store alone, in ns;
- `lanes`: the same products by vpdpbusd over the AMX prototype's layout (int32 lanes = 16 weight rows, each x dword a
  broadcast, one decode for all activation rows), then the same loop without its weight decode, without its fp32 step
  and without both: where a k-row product's time goes;
- `mix`: G vpdpbusd/s of the kernels' instruction mix on register operands, of the one-row tile's pattern with its
  operands from L1 and no weight decode, and of bare vpdpbusd.
It needs AVX-512 VNNI (and for `amx`, AMX tiles: elsewhere it says so and measures nothing).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

from ..pull import home_dir

SOURCE = Path(__file__).with_name("harness") / "vnni_tiles.cpp"
KERNEL = Path(__file__).parents[1] / "kernels" / "qmatmul_vnni.cpp"
FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-mavx512f", "-mavx512bw",
         "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def build() -> Path:
    """The harness binary, built once per source (the kernel unit's included)."""
    h = hashlib.sha256()
    for p in (SOURCE, KERNEL, *sorted(KERNEL.parent.glob("*.h"))):
        h.update(p.read_bytes())
    h.update(" ".join(FLAGS).encode())
    out = home_dir().expanduser() / "harness" / f"vnni_tiles_{h.hexdigest()[:12]}"
    if not out.exists():
        gxx = shutil.which("g++")
        if gxx is None:
            raise RuntimeError("the harness is built with g++, which is not on PATH")
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"building {out.name} (about 40 s)...", file=sys.stderr)
        tmp = out.with_suffix(".tmp")
        subprocess.run([gxx, *FLAGS, str(SOURCE), "-o", str(tmp)], check=True)
        tmp.replace(out)
    return out


def parse_ks(text: str) -> list[int]:
    try:
        ks = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--ks takes comma-separated integers, got {text!r}") from None
    if not ks or any(not 1 <= k <= 16 for k in ks):
        raise ValueError(f"--ks takes rows per product in 1..16, got {text!r}")
    return ks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ultrafast.benchmarks.kernel_harness", description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["tiles", "amx", "lanes", "mix"])
    ap.add_argument("--rows", type=int, default=512, help="weight rows (a multiple of 16)")
    ap.add_argument("--cols", type=int, default=1536, help="values per row (a multiple of 512)")
    ap.add_argument("--ks", default="1,4,10,16", help="activation rows per product, comma-separated, 1..16")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    try:
        ks = parse_ks(args.ks)
        if args.rows < 16 or args.rows % 16 or args.cols < 512 or args.cols % 512:
            raise ValueError(f"--rows must be a multiple of 16 and --cols of 512, got {args.rows} x {args.cols}")
        if args.reps < 1:
            raise ValueError(f"--reps must be at least 1, got {args.reps}")
        if "avx512_vnni" not in cpu_flags():
            raise ValueError("the harness runs the VNNI kernels: this CPU has no AVX-512 VNNI")
        exe = build()
    except (ValueError, RuntimeError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs = [[str(exe), "mix", str(max(1, args.reps // 50))]] if args.what == "mix" else \
        [[str(exe), args.what, str(args.rows), str(args.cols), str(k), str(args.reps)] for k in ks]
    for cmd in runs:
        r = subprocess.run(cmd, capture_output=True, text=True)
        sys.stdout.write(r.stdout)
        if r.returncode != 0:
            print(f"error: the harness failed ({r.returncode}): {r.stderr.strip()}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

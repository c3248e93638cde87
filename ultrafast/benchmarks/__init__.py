"""Benchmarks, each a CLI verb: `bench` (decode vs the memory roofline and llama.cpp), `specbench`
(Spec-Bench, both tiers side by side), `agentbench` (an agent loop re-sending the same file)."""


def ceiling_line(r: list[float]) -> str:
    from ..speculative import speedup_ceiling

    best, k = speedup_ceiling(r)
    return (f"ceiling if every draft were accepted: {best:.2f}x (k = {k}; verify cost r(k) "
            + " ".join(f"r({n})={r[n]:.2f}" for n in (2, 4, 8, 16) if n < len(r)) + ")")

"""`ultrafast bench` end to end on SmolLM2 with small sizes (figures are not asserted: the machine is shared;
the shape and the invariants of the report are), and the r(k) measurement it shares with the adaptive policy."""

import pytest

from ultrafast.benchmarks.decode import acceptance_needed, format_table, run_bench
from ultrafast.speculative import measure_r


def test_bench_report(smollm_path):
    r = run_bench(str(smollm_path), prompt_len=16, gen=8, max_k=4, reps=1, llama_cpp=False)
    ours = r["ultrafast"]
    assert ours["decode_tokens_per_s"] > 0 and ours["ttft_ms"] > 0 and ours["prefill_tokens_per_s"] > 0
    assert set(ours["r_k"]) == {1, 2, 3, 4} and ours["r_k"][1] == 1.0
    assert ours["achieved_gb_per_s"] == pytest.approx(ours["decode_tokens_per_s"] * r["weight_bytes_per_token"] / 1e9)
    assert r["llama_cpp"] is None and r["decode_ratio_vs_llama_cpp"] is None
    # one copy of what the kernels stream (on the VNNI kernels their own layouts), the rest read from the file
    assert r["weight_bytes_held"] <= 1.15 * r["file_tensor_bytes"]  # (and a llama file's permuted Q, K rows)
    assert r["weight_bytes_layout"] <= r["weight_bytes_held"]
    assert r["weight_bytes_held"] + r["weight_bytes_in_file"] >= r["file_tensor_bytes"]
    assert (r["weight_bytes_layout"] > 0) == ("vnni" in r["kernels"])  # SmolLM2's Q4_1 linears: repacked
    table = format_table(r)
    assert "decode tok/s" in table and "r(k)" in table
    mp = r["multiply_peak"]
    if "vnni" in r["kernels"]:
        # the physical r(k): the longer of one weight stream and k rows of multiplies at the measured peak
        t_mem = r["weight_bytes_per_token"] / (r["read_gb_per_s_2_threads"] * 1e9)
        for k in (1, 2, 3, 4):
            want = max(t_mem, k * mp["macs_per_token"] / mp["macs_per_s"]) / max(t_mem, mp["macs_per_token"] / mp["macs_per_s"])
            assert mp["physical_r_k"][k] == pytest.approx(want)
            assert 0 < mp["pct_of_peak_k"][k] < 100
        assert mp["physical_r_k"][1] == 1.0 and mp["physical_r_k"][4] >= mp["physical_r_k"][2] >= 1.0
        # the same bound at the rate of the kernels' own arithmetic (two timings on a shared machine: their order
        # is not asserted, the formula and the monotonicity are)
        arith = mp["arithmetic_macs_per_s"]
        assert arith > 0
        # SmolLM2's Q4_1 linears run on a paired layout (Q4_1_R16)
        assert 0.0 < mp["paired_share"] <= 1.0
        for k in (1, 2, 3, 4):
            want = max(t_mem, k * mp["macs_per_token"] / arith) / max(t_mem, mp["macs_per_token"] / arith)
            assert mp["arithmetic_r_k"][k] == pytest.approx(want)
        assert mp["arithmetic_r_k"][1] == 1.0 and mp["arithmetic_r_k"][4] >= mp["arithmetic_r_k"][2] >= 1.0
        assert "arithmetic" in table
        assert 0 < mp["pct_of_peak_prefill"] < 100 and mp["macs_per_token_prefill"] < mp["macs_per_token"]
        assert "physical" in table and "% of peak" in table and "multiply peak" in table
    elif "avx2" in r["kernels"]:
        # the AVX2 fp32 kernels: the physical r(k) at the measured FMA rate; no arithmetic row
        t_mem = r["weight_bytes_per_token"] / (r["read_gb_per_s_2_threads"] * 1e9)
        assert mp["vpdpbusd_per_s"] is None and mp["activation_bits"] == 32
        assert mp["macs_per_s"] == pytest.approx(8 * mp["fma_per_s"]) and mp["fma_per_s"] > 1e8
        for k in (1, 2, 3, 4):
            want = max(t_mem, k * mp["macs_per_token"] / mp["macs_per_s"]) / max(t_mem, mp["macs_per_token"] / mp["macs_per_s"])
            assert mp["physical_r_k"][k] == pytest.approx(want)
            assert 0 < mp["pct_of_peak_k"][k] < 100
        assert mp["arithmetic_r_k"] is None and "arithmetic" not in table
        assert "G 8-lane FMA/s" in table and "physical" in table and "% of peak" in table
    else:
        assert mp is None and "physical" not in table


def test_measure_r(smollm_engine):
    r = measure_r(smollm_engine, max_k=3, reps=1, prefix=[1, 2, 3], probe=[5, 6, 7, 8])
    assert len(r) == 5 and r[1] == 1.0 and all(x > 0 for x in r[1:])
    with pytest.raises(ValueError, match="probe tokens"):
        measure_r(smollm_engine, max_k=3, reps=1, probe=[5, 6])


def test_bench_picture(smollm_path, tmp_path):
    """`bench --json F` writes F and the picture beside it: r(k) against the physical r(k), decode tok/s."""
    import json

    from ultrafast import report
    from ultrafast.benchmarks.decode import plot

    r = run_bench(str(smollm_path), prompt_len=16, gen=8, max_k=3, reps=1, llama_cpp=False, progress=None)
    png = report.write(str(tmp_path / "bench.json"), r, lambda p: plot(r, p))
    assert png == tmp_path / "bench.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    back = json.loads((tmp_path / "bench.json").read_text())
    assert back["ultrafast"]["decode_tokens_per_s"] == pytest.approx(r["ultrafast"]["decode_tokens_per_s"])
    assert set(back["ultrafast"]["r_k"]) == {"1", "2", "3"}
    plot(back, tmp_path / "again.png")  # the JSON's string keys draw the same picture
    assert (tmp_path / "again.png").stat().st_size > 10_000


def test_acceptance_needed():
    """The acceptance per draft a chain needs for a speedup at given verify costs: a pass costing what k + 1 steps cost
    can never pay; free rows need a = 0.5 for 2 tokens a pass at k -> large, less as k grows; costlier rows more."""
    free = {k: 1.0 for k in range(1, 17)}
    k, a = acceptance_needed(free, 2.0)
    assert k == 15 and 0.5 < a < 0.51  # 1 + a + ... + a^15 = 2
    assert acceptance_needed(free, 1.5)[1] < a < acceptance_needed(free, 3.0)[1]
    assert acceptance_needed({k: float(k) for k in range(1, 17)}, 1.01) is None  # a row costs a step
    steep = {k: 1.0 + 0.3 * (k - 1) for k in range(1, 17)}
    assert acceptance_needed(steep, 2.0)[1] > a
    k2, a2 = acceptance_needed(steep, 2.0, draft_cost=0.06)
    assert a2 > acceptance_needed(steep, 2.0)[1]
    # the chain at that acceptance gives the speedup
    assert sum(a2 ** i for i in range(k2 + 1)) / (steep[k2 + 1] + 0.06 * k2) == pytest.approx(2.0, rel=1e-6)
    with pytest.raises(ValueError):
        acceptance_needed(free, 0.0)

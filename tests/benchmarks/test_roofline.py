"""`ultrafast roofline`: the bounds' arithmetic, gloo's all-reduce measured for real, the picture."""

import pytest

from ultrafast import report
from ultrafast.benchmarks.roofline import HARDWARE, ModelFacts, allreduce_latency, bounds, physical_r, plot


def test_bounds_arithmetic():
    m = ModelFacts("m", bytes_per_token=1e9, macs_per_token=1.5e9, layers=28, dim=1536)
    rows = bounds(m, cpu_bandwidth=50e9, cpu_macs=2e11, cpu_memory=24e9, allreduce_s=100e-6, machines=[1, 4],
                  tau=2.0, k=4)
    one, four = rows[0], rows[1]
    assert one.tokens_per_s == pytest.approx(50.0)  # 50 GB/s / 1 GB
    # four machines: a quarter of the bytes each, plus two all-reduces per layer per token
    assert four.tokens_per_s == pytest.approx(1 / (1e9 / 200e9 + 2 * 28 * 100e-6))
    # ultrafast: tau / r(k) with r(4) the longer of the weight stream and 4 rows of multiplies
    r4 = physical_r(4, 1e9, 50e9, 1.5e9, 2e11)
    assert r4 == pytest.approx(max(0.02, 4 * 1.5e9 / 2e11) / max(0.02, 1.5e9 / 2e11)) and r4 > 1
    assert one.ultrafast_tokens_per_s == pytest.approx(50.0 * 2.0 / r4)
    slow = bounds(m, cpu_bandwidth=50e9, cpu_macs=2e10, cpu_memory=24e9, allreduce_s=0, machines=[1], tau=1.1,
                  k=8)[0]  # multipliers slower than the stream: the pass is compute-bound, drafting does not pay
    assert slow.tokens_per_s == pytest.approx(2e10 / 1.5e9) and slow.ultrafast_tokens_per_s == slow.tokens_per_s
    h200 = next(b for b in rows if b.hardware == "H200")
    assert h200.devices == 1 and h200.tokens_per_s == pytest.approx(HARDWARE["H200"]["bandwidth"] / 1e9)
    big = ModelFacts("big", bytes_per_token=141e9, macs_per_token=70e9, layers=80, dim=8192)
    rows = bounds(big, cpu_bandwidth=50e9, cpu_macs=2e11, cpu_memory=24e9, allreduce_s=1e-4, machines=[1], tau=1,
                  k=1)
    wafer = next(b for b in rows if b.hardware.startswith("WSE"))
    assert wafer.devices == 4 and wafer.tokens_per_s == pytest.approx(21e15 / 141e9)  # pipelined: no sum
    assert rows[0].note == "does not fit in memory"
    assert next(b for b in rows if b.hardware == "H100 SXM").devices == 2


def test_allreduce_latency_is_measured():
    s = allreduce_latency(256, reps=20)
    assert 0 < s < 0.1


def test_roofline_picture(tmp_path):
    m = ModelFacts("m", 1e9, 1.5e9, 28, 1536)
    rows = bounds(m, cpu_bandwidth=50e9, cpu_macs=2e11, cpu_memory=24e9, allreduce_s=1e-4, machines=[1, 2], tau=1.5,
                  k=4)
    png = report.write(str(tmp_path / "r.json"), {"rows": []}, lambda p: plot(rows, p))
    assert png.read_bytes()[:4] == b"\x89PNG"

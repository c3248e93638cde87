"""`python -m ultrafast.benchmarks.hugepages`: the streamed bytes on huge pages against the same bytes on 4 KB pages."""

from ultrafast.benchmarks.hugepages import main
from ultrafast.packed import PackedLinear


def test_rebinds_what_the_kernels_stream_and_restores_it(smollm_path, capsys, monkeypatch):
    seen = []
    real = PackedLinear.weights

    def spy(self, layouts=None):
        w = real(self, layouts)
        seen.append(w[0].data_ptr())
        return w

    monkeypatch.setattr(PackedLinear, "weights", spy)
    assert main(["--model", str(smollm_path), "--steps", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "4 KB pages / huge pages" in out and "median ms per decode step" in out
    assert len(set(seen)) >= 2 * 7  # two sets of streamed bytes took turns (no layout made again from the file)

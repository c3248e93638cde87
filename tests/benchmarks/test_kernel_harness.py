"""The kernel harness: its input errors, and (where the CPU runs the VNNI kernels) every variant's bits against the
engine's kernel on a small matrix."""

import re
import shutil

import pytest

from ultrafast.benchmarks import kernel_harness

VNNI = "avx512_vnni" in kernel_harness.cpu_flags() and shutil.which("g++") is not None


def test_bad_input_is_one_error_line(capsys):
    assert kernel_harness.main(["tiles", "--ks", "1,x"]) == 2
    assert kernel_harness.main(["tiles", "--ks", "17"]) == 2
    assert kernel_harness.main(["amx", "--rows", "40"]) == 2
    assert kernel_harness.main(["amx", "--cols", "1000"]) == 2
    assert kernel_harness.main(["lanes", "--rows", "24"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and all(line.startswith("error: ") for line in err)


@pytest.mark.skipif(not VNNI, reason="needs AVX-512 VNNI and g++")
def test_variants_keep_the_engines_bits(capsys):
    assert kernel_harness.main(["tiles", "--rows", "64", "--cols", "1024", "--ks", "3,10", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("bits same") == 2 * 2 * 6 and "DIFFER" not in out  # 2 ks x 2 rounds x 6 schedules
    assert kernel_harness.main(["amx", "--rows", "64", "--cols", "1024", "--ks", "1,7,16", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert "DIFFER" not in out
    if "no AMX" not in out:  # where the tiles run, both of the prototype's variants at every k, both rounds
        assert out.count("bits same") == 3 * 2 * 2
    assert kernel_harness.main(["lanes", "--rows", "64", "--cols", "1024", "--ks", "1,7,16", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("bits same") == 3 * 2 and "DIFFER" not in out and out.count("without both") == 3 * 2


@pytest.mark.skipif(not VNNI, reason="needs AVX-512 VNNI and g++")
def test_mix_reports_three_rates(capsys):
    assert kernel_harness.main(["mix", "--reps", "50"]) == 0
    rates = [float(m.group(1)) for m in re.finditer(r"([0-9.]+) G(?: vpdpbusd)?/s", capsys.readouterr().out)]
    assert len(rates) == 3 and all(r > 0.05 for r in rates)
    reg, pattern, bare = rates
    assert pattern < bare * 1.2 and reg < bare * 1.2  # nothing beats the bare multiply rate, beyond noise

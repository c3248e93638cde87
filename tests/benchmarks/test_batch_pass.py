"""`python -m ultrafast.benchmarks.batch_pass`: a pass of several sequences against one sequence with as many rows."""

import json

import pytest

from ultrafast.benchmarks.batch_pass import main, rows_per_sequence


def test_rows_are_spread_over_the_sequences():
    assert rows_per_sequence(10, 10) == [1] * 10
    assert rows_per_sequence(13, 10) == [2, 2, 2] + [1] * 7
    assert rows_per_sequence(21, 10) == [3] + [2] * 9
    with pytest.raises(ValueError, match="cannot give each of 10 sequences a row"):
        rows_per_sequence(9, 10)


def test_each_pass_is_timed_both_ways(smollm_path, tmp_path, capsys):
    out = tmp_path / "pass.json"
    assert main(["--model", str(smollm_path), "--seqs", "3", "--rows", "5,3", "--prompt-tokens", "8",
                 "--own-tokens", "4", "--reps", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["seqs"] == 3 and r["step_ms"] > 0
    assert [x["rows"] for x in r["passes"]] == [3, 5]  # sorted
    for x in r["passes"]:
        assert x["batched_ms"] > 0 and x["one_sequence_ms"] > 0
        assert x["caches_ms"] == pytest.approx(x["batched_ms"] - x["one_sequence_ms"])
        assert x["batched_r"] == pytest.approx(x["batched_ms"] / r["step_ms"])
    lo, hi = r["passes"]
    assert r["further_row_ms"] == pytest.approx((hi["batched_ms"] - lo["batched_ms"]) / 2)
    text = capsys.readouterr().out
    assert "a further row:" in text and "their caches ms" in text


def test_bad_arguments_are_one_error_line(smollm_path, capsys):
    assert main(["--model", str(smollm_path), "--seqs", "4", "--rows", "3"]) == 2
    assert main(["--model", str(smollm_path), "--rows", "10,x"]) == 2
    assert main(["--model", str(smollm_path), "--seqs", "2", "--rows", "2", "--prompt-tokens", "0"]) == 2
    assert main(["--model", "no-such-model", "--seqs", "2", "--rows", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("error: ") for line in err)

"""`python -m ultrafast.benchmarks.kernel_shapes`: every linear of a layer, from memory and from cache."""

import json

from ultrafast.benchmarks.kernel_shapes import main


def test_each_linear_is_timed_from_memory_and_from_cache(smollm_path, tmp_path, capsys):
    out = tmp_path / "shapes.json"
    assert main(["--model", str(smollm_path), "--ks", "1,3", "--reps", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["layers"] == 30 and {x["linear"] for x in r["rows"]} == {"wq", "wk", "wv", "wo", "w1", "w3", "w2"}
    assert [x["k"] for x in r["rows"]][:2] == [1, 3] and len(r["rows"]) == 14
    for x in r["rows"]:
        assert x["memory_ms"] > 0 and x["cached_ms"] > 0 and x["memory_gb_s"] > 0
        assert (x["pct_of_peak"] is None) == (r["vpdpbusd_per_s"] is None)
    assert "memory/cached" in capsys.readouterr().out


def test_bad_arguments_are_one_error_line(capsys):
    assert main(["--model", "no-such-model", "--ks", "1"]) == 2
    assert capsys.readouterr().err.startswith("error:")

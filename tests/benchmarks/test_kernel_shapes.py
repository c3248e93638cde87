"""`python -m ultrafast.benchmarks.kernel_shapes`: every linear of a layer, from memory and from cache."""

import json

from ultrafast.benchmarks.kernel_shapes import main


def test_each_linear_is_timed_from_memory_and_from_cache(smollm_path, tmp_path, capsys):
    out = tmp_path / "shapes.json"
    assert main(["--model", str(smollm_path), "--ks", "1,3", "--reps", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    names = {"wq", "wk", "wv", "wo", "w1", "w3", "w2", "output"}  # the layers' linears and the LM head
    assert r["layers"] == 30 and {x["linear"] for x in r["rows"]} == names
    assert [x["k"] for x in r["rows"]][:2] == [1, 3] and len(r["rows"]) == 16
    for x in r["rows"]:
        assert x["memory_ms"] > 0 and x["memory_gb_s"] > 0
        assert (x["cached_ms"] is None) == (x["linear"] == "output")  # one matrix: from memory only
        assert x["linear"] == "output" or x["cached_ms"] > 0
        assert (x["pct_of_peak"] is None) == (r["vpdpbusd_per_s"] is None)
    head = [x for x in r["rows"] if x["linear"] == "output"]
    assert [(x["out"], x["in"]) for x in head] == [(49152, 576)] * 2  # SmolLM2's vocabulary x width
    assert "memory/cached" in capsys.readouterr().out


def test_the_layouts_are_timed_against_the_files_bytes(smollm_path, tmp_path, capsys, vnni):
    """--vs-file-layout: each linear also on the file's bytes (SmolLM2's Q4_1, read by the kernels in their own
    layout); without it no such figure."""
    from ultrafast import kernels

    out = tmp_path / "shapes.json"
    assert main(["--model", str(smollm_path), "--ks", "2", "--reps", "1", "--vs-file-layout", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 8 and all(x["file_layout_ms"] > 0 for x in rows)
    assert all(x["qtype_read"] == kernels.Q4_1_R16 for x in rows if x["linear"] != "output")
    assert "layout/file" in capsys.readouterr().out
    assert main(["--model", str(smollm_path), "--ks", "1", "--reps", "1", "--json", str(out)]) == 0
    assert all(x["file_layout_ms"] is None for x in json.loads(out.read_text())["rows"])


def test_bad_arguments_are_one_error_line(capsys):
    assert main(["--model", "no-such-model", "--ks", "1"]) == 2
    assert capsys.readouterr().err.startswith("error:")

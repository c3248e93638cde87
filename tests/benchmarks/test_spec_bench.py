"""`specbench`'s measurement on two questions: both tiers, exactness, per-drafter acceptance in the table."""

from ultrafast.benchmarks.spec_bench import format_table, run_spec_bench


def test_spec_bench_table(smollm_engine):
    questions = [("qa", "Repeat after me: the quick brown fox jumps over the lazy dog."),
                 ("translation", "Translate to French: good morning, my friend.")]
    table, summary = run_spec_bench(smollm_engine, questions, max_tokens=24, drafters=["prompt_lookup", "suffix"],
                                    progress=None)
    assert list(table) == ["translation", "qa"] and summary["exact"]
    assert all(v["questions"] == 1 and v["tau"] >= 1.0 and v["standard_tok_s"] > 0 for v in table.values())
    d = summary["drafters"]
    assert set(d) == {"prompt_lookup", "suffix"}
    assert all(0 <= v["accepted"] <= v["drafted"] for v in d.values()) and sum(v["passes"] for v in d.values()) > 0
    text = format_table(table, summary, "t")
    assert "drafters: " in text and "prompt_lookup" in text and "identical to standard: yes" in text


def test_spec_bench_picture(tmp_path):
    """Tokens/s per category and tier (llama.cpp's bars where it ran), from a table in the verb's shape."""
    from ultrafast import report
    from ultrafast.benchmarks.spec_bench import plot

    row = {"questions": 1, "standard_tok_s": 20.0, "ultrafast_tok_s": 30.0, "speedup": 1.5, "tau": 1.8,
           "mean_r_k": 1.2, "llama_cpp_tok_s": 18.0, "llama_cpp_pld_tok_s": 19.0}
    table = {"qa": row, "translation": {**row, "llama_cpp_tok_s": None}}
    png = report.write(str(tmp_path / "sb.json"), {"table": table}, lambda p: plot(table, "Spec-Bench", p))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

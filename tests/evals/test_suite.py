"""`ultrafast evals suite`: both sets through a server started for the run, in both tiers, greedy: the same
texts in both tiers, the spend read from the server's ledger (the ultrafast tier at its price), a picture."""

from __future__ import annotations

import json
import subprocess
import sys


def test_a_small_suite_in_both_tiers(tmp_path, smollm_path):
    from ultrafast import kernels

    # int8 activations where this CPU has integer kernels for them (the server refuses them elsewhere), else the default
    bits = "8" if kernels.available() and kernels.linear_path(kernels.Q4_1, 8) else "16"
    out, summary = tmp_path / "records.jsonl", tmp_path / "suite.json"
    questions = tmp_path / "question.jsonl"  # Spec-Bench's format (a clean clone has no ../shared beside it)
    questions.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n" for i, (c, t) in
                                 enumerate([("writing", "Write a haiku about rain."), ("qa", "Who wrote Hamlet?"),
                                            ("math_reasoning", "What is 17 times 3?"), ("rag", "Unused.")])))
    p = subprocess.run([sys.executable, "-m", "ultrafast.cli", "evals", "suite", "--model", str(smollm_path),
                        "--questions", str(questions), "--limit", "3", "--concurrency", "2", "--max-tokens", "16",
                        "--activation-bits", bits, "--out", str(out), "--json", str(summary)],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"--activation-bits {bits}`" in p.stderr  # the server started for the run, with those activations
    runs = {(r["set"], r["tier"]): r for r in json.loads(summary.read_text())}
    assert set(runs) == {(s, t) for s in ("specbench", "humaneval") for t in ("standard", "ultrafast")}
    for s in ("specbench", "humaneval"):
        std, fast = runs[s, "standard"], runs[s, "ultrafast"]
        assert std["requests"] == fast["requests"] == 3 and std["completion_tokens"] == fast["completion_tokens"]
        assert 0 < std["cost_usd"] < fast["cost_usd"]  # billed by the ledger, the ultrafast tier at its price
    records = [json.loads(line) for line in out.read_text().splitlines()]
    texts = {(r["set"], r["tier"], r["index"]): r["text"] for r in records}
    assert len(records) == 12
    assert all(texts[s, "standard", i] == texts[s, "ultrafast", i] for s in ("specbench", "humaneval") for i in range(3))
    assert "standard / ultrafast wall-clock" in p.stdout
    assert summary.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_an_unknown_set_is_an_error_line():
    p = subprocess.run([sys.executable, "-m", "ultrafast.cli", "evals", "suite", "--sets", "mmlu", "--url",
                        "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("error:") and "mmlu" in p.stderr


def test_per_category_takes_the_first_questions_of_each_category(tmp_path):
    from ultrafast.evals.suite import prompts

    questions = tmp_path / "question.jsonl"
    rows = [("writing", "w1"), ("roleplay", "r1"), ("writing", "w2"), ("translation", "t1"), ("translation", "t2"),
            ("translation", "t3"), ("rag", "g1")]
    questions.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
                                 for i, (c, t) in enumerate(rows)))
    texts = [m[0]["content"] for m in prompts("specbench", None, str(questions), 2)]
    assert texts == ["w1", "r1", "t1", "t2", "g1"]  # MT-Bench's sub-categories count as one, as in specbench
    assert len(prompts("specbench", None, str(questions))) == 7


def test_bad_per_category_is_an_error_line():
    p = subprocess.run([sys.executable, "-m", "ultrafast.cli", "evals", "suite", "--per-category", "0", "--url",
                        "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("error:") and "--per-category" in p.stderr


def test_the_agent_set_is_the_agent_loops_first_edits():
    """`--sets agent`: agentbench's file with each of its tasks, as the agent loop sends its first edit."""
    from ultrafast.benchmarks.agent_loop import START_FILE, TASKS
    from ultrafast.evals.suite import prompts

    got = prompts("agent", None, None)
    assert len(got) == len(TASKS) and [m["role"] for m in got[0]] == ["system", "user"]
    assert all(START_FILE in m[1]["content"] and m[1]["content"].endswith(t) for m, t in zip(got, TASKS))
    assert len(prompts("agent", 2, None)) == 2

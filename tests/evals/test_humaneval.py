"""`ultrafast evals humaneval`: the program built from a model's answer, pass@k, every reference solution
passing in the sandbox, and a small run end to end through a server started for it."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import pytest

from ultrafast.evals.humaneval import load_problems, pass_at_k, program
from ultrafast.evals.sandbox import Limits, Sandbox


@pytest.fixture(scope="module")
def problems():
    return load_problems()


def test_164_problems_in_order(problems):
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    assert load_problems(3) == problems[:3]


def test_pass_at_k():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 1, 10) == 1.0 and pass_at_k(4, 1, 2) == pytest.approx(0.5)


def test_answers_become_programs(problems):
    p = problems[2]  # truncate_number(number: float) -> float
    fenced = f"Here it is:\n```python\ndef truncate_number(number: float) -> float:\n    return number % 1.0\n```\nDone."
    code = program(p, fenced)
    assert code.startswith("def truncate_number") and "Done." not in code and code.endswith("check(truncate_number)\n")
    body = program(p, "    return number % 1.0\n")  # a continuation of the prompt
    assert body.startswith(p["prompt"]) and "return number % 1.0" in body
    unclosed = program(p, "```python\ndef truncate_number(number):\n    return number % 1.0\n")
    assert "def truncate_number(number):" in unclosed


def test_reference_solutions_pass_and_wrong_ones_fail(problems):
    sandbox = Sandbox(Limits(seconds=10))
    for p in problems[:12]:
        assert sandbox.run(program(p, "```python\n" + p["prompt"] + p["canonical_solution"] + "```")).passed, p["task_id"]
        assert sandbox.run(program(p, p["canonical_solution"])).passed, p["task_id"]
        assert not sandbox.run(program(p, "    return None\n")).passed, p["task_id"]


def test_a_small_run_through_the_server(tmp_path, smollm_path):
    out, summary = tmp_path / "records.jsonl", tmp_path / "summary.json"
    p = subprocess.run([sys.executable, "-m", "ultrafast.cli", "evals", "humaneval", "--model", str(smollm_path),
                        "--limit", "2", "--n", "3", "--tier", "both", "--max-tokens", "48", "--exec-timeout", "5",
                        "--out", str(out), "--json", str(summary)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = json.loads(summary.read_text())
    assert [(s["tier"], s["n"], s["problems"]) for s in runs] == [
        ("standard", 3, 2), ("standard", 1, 2), ("ultrafast", 3, 2), ("ultrafast", 1, 2)]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 8 and all(len(r["statuses"]) == r["n"] for r in records)
    assert all(r["completion_tokens"] > 0 and r["generation_s"] > 0 for r in records)
    # each candidate's tokens, from the server's time_info, add up to the request's
    assert all(len(r["candidate_tokens"]) == r["n"] and sum(r["candidate_tokens"]) == r["completion_tokens"]
               for r in records)
    # problem by problem: each problem's four runs back to back
    assert [(r["task_id"], r["tier"], r["n"]) for r in records[:4]] == [
        ("HumanEval/0", "standard", 3), ("HumanEval/0", "standard", 1), ("HumanEval/0", "ultrafast", 3),
        ("HumanEval/0", "ultrafast", 1)]
    # each run is its own tenant: no request finds the same problem's request before it in the KV slots (without
    # the runs' salts the n = 1 request after n = 3 reused 189 of its 190 prompt tokens)
    assert all(r["cached_tokens"] < r["prompt_tokens"] // 2 for r in records)
    # ... and each run finds its own rows of the problem before (the chat template's and system prompt's shared
    # prefix) alike: with three slots for the n = 3 and n = 1 runs the n = 1 run found none (its slot was taken)
    second = records[4:]
    assert second[0]["cached_tokens"] > 0 and len({r["cached_tokens"] for r in second}) == 1, second
    assert "| standard | 3 | 2 |" in p.stdout and "wall-clock of n = 1" in p.stdout
    assert "on the 2 problems with each candidate's tokens" in p.stdout
    assert "ultrafast n = 3 took" in p.stdout and "the wall-clock of standard n = 1" in p.stdout
    png = summary.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    # --resume with one more problem: only the third problem's four requests run
    p = subprocess.run([sys.executable, "-m", "ultrafast.cli", "evals", "humaneval", "--model", str(smollm_path),
                        "--limit", "3", "--n", "3", "--tier", "both", "--max-tokens", "48", "--exec-timeout", "5",
                        "--out", str(out), "--json", str(summary), "--resume"], capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming: 8 records" in p.stderr
    again = [json.loads(line) for line in out.read_text().splitlines()]
    assert again[:8] == records and len(again) == 12
    assert {r["task_id"] for r in again[8:]} == {"HumanEval/2"}
    assert [s["problems"] for s in json.loads(summary.read_text())] == [3, 3, 3, 3]


def test_resume_takes_only_records_made_with_the_same_settings(tmp_path):
    import argparse

    from ultrafast.evals.humaneval import ProblemResult, resumable, settings

    args = argparse.Namespace(temperature=0.8, top_p=0.95, max_tokens=512, seed=0, exec_timeout=10.0)
    mine = settings(args, "m")
    other = settings(argparse.Namespace(**{**vars(args), "seed": 1}), "m")
    path = tmp_path / "records.jsonl"
    rows = [ProblemResult("HumanEval/0", "standard", 10, 3, 0, 1.0, 0.1, 50, 20, settings=mine),
            ProblemResult("HumanEval/0", "ultrafast", 10, 3, 0, 1.0, 0.1, 50, 20, settings=other),
            ProblemResult("HumanEval/1", "standard", 10, 0, None, 1.0, 0.1, 50, 20)]  # no settings: an old record
    path.write_text("".join(json.dumps(asdict(r)) + "\n" for r in rows) + "not json\n")
    done, ignored = resumable(path, mine)
    assert list(done) == [("HumanEval/0", "standard", 10)] and done[("HumanEval/0", "standard", 10)] == rows[0]
    assert ignored == 3
    assert resumable(tmp_path / "absent.jsonl", mine) == ({}, 0)


def test_resume_tells_the_activation_bits_apart(tmp_path):
    import argparse

    from ultrafast.evals.humaneval import ProblemResult, resumable, settings

    args = argparse.Namespace(temperature=0.8, top_p=0.95, max_tokens=512, seed=0, exec_timeout=10.0, url=None,
                              activation_bits=None)
    mine = settings(args, "m")
    assert mine["activation_bits"] == 16  # the server started for the run, at its default
    eight = settings(argparse.Namespace(**{**vars(args), "activation_bits": 8}), "m")
    before = {k: v for k, v in mine.items() if k != "activation_bits"}  # a record from before the option
    at_url = settings(argparse.Namespace(**{**vars(args), "url": "http://127.0.0.1:8000"}), "m")
    assert at_url["activation_bits"] is None  # a server at --url: its own setting, not known
    path = tmp_path / "records.jsonl"
    rows = [ProblemResult(f"HumanEval/{i}", "standard", 10, 3, 0, 1.0, 0.1, 50, 20, settings=st)
            for i, st in enumerate([mine, eight, before])]
    path.write_text("".join(json.dumps(asdict(r)) + "\n" for r in rows))
    done, ignored = resumable(path, mine)
    assert sorted(done) == [("HumanEval/0", "standard", 10), ("HumanEval/2", "standard", 10)] and ignored == 1
    done, ignored = resumable(path, eight)
    assert list(done) == [("HumanEval/1", "standard", 10)] and ignored == 2


def test_activation_bits_with_url_is_an_error_line():
    p = subprocess.run([sys.executable, "-m", "ultrafast.cli", "evals", "humaneval", "--activation-bits", "8",
                        "--url", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("error:") and "--activation-bits" in p.stderr


def test_length_split_parts_the_wall_clock_ratio():
    from ultrafast.evals.humaneval import ProblemResult, length_split

    def rec(task, n, seconds, tokens, candidates=()):
        return ProblemResult(task, "standard", n, 0, None, seconds, 0.0, tokens, 10,
                             candidate_tokens=list(candidates))

    # problem 0: the longest of three ran 100 passes in 20 s; n = 1 made 50 tokens in 5 s
    # problem 1: an old record without the counts is left out of both sums
    many = [rec("HumanEval/0", 3, 20.0, 180, (40, 100, 40)), rec("HumanEval/1", 3, 9.0, 90)]
    one = [rec("HumanEval/0", 1, 5.0, 50, (50,)), rec("HumanEval/1", 1, 3.0, 30, (30,))]
    problems, L, S = length_split(many, one)
    assert problems == 1 and L == pytest.approx(2.0) and S == pytest.approx((20.0 / 100) / (5.0 / 50))
    assert L * S == pytest.approx(20.0 / 5.0)  # the wall-clock ratio on those problems
    assert length_split(many[1:], one[1:]) is None


def test_bad_n_is_an_error_line():
    p = subprocess.run([sys.executable, "-m", "ultrafast.cli", "evals", "humaneval", "--n", "40", "--url",
                        "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("error:") and "--n" in p.stderr

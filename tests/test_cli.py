"""The command line, in a subprocess as a user runs it."""

import json
import subprocess
import sys

EXE = [sys.executable, "-m", "ultrafast.cli"]


def run(*args, input=None):
    return subprocess.run(EXE + list(args), capture_output=True, text=True, input=input, timeout=600)


def test_generate_json(smollm_path):
    p = run("generate", "--model", str(smollm_path), "--prompt", "Name a colour.", "--max-tokens", "8", "--json")
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout)
    for key in ("token_ids", "text", "prompt_tokens", "completion_tokens", "ttft_s", "decode_tokens_per_s",
                "achieved_gb_per_s", "finish_reason"):
        assert key in rec
    assert 1 <= len(rec["token_ids"]) <= 8 and rec["prompt_tokens"] > 5
    assert "read per token" in p.stderr  # the load report


def test_prompts_file_answers_each_line_in_order(smollm_path, tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join([
        json.dumps({"messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 3}),
        "{not json",
        json.dumps({"prompt": "<|im_start|>user\nSay no.<|im_end|>\n<|im_start|>assistant\n", "max_tokens": 2}),
        json.dumps({"neither": 1}),
    ]) + "\n")
    p = run("generate", "--model", str(smollm_path), "--prompts-file", str(f), "--json")
    assert p.returncode == 0, p.stderr
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    assert len(lines) == 4
    assert len(lines[0]["token_ids"]) <= 3 and "error" in lines[1] and lines[1]["line"] == 2
    assert len(lines[2]["token_ids"]) <= 2 and "needs 'messages' or 'prompt'" in lines[3]["error"]


def test_errors_are_messages_not_tracebacks(tmp_path):
    p = run("generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "x")
    assert p.returncode == 2 and "error:" in p.stderr and "Traceback" not in p.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 10)
    p = run("generate", "--model", str(bad), "--prompt", "x")
    assert p.returncode == 2 and "bad.gguf" in p.stderr and "Traceback" not in p.stderr
    p = run("generate", "--model", str(bad), "--prompt", "x", "--temperature", "-1")
    assert p.returncode == 2 and "temperature" in p.stderr


def test_chat_streams_and_keeps_going(smollm_path):
    p = run("chat", "--model", str(smollm_path), "--max-tokens", "6", input="Hello\nAnd again\n\n")
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("tokens at") == 2  # one report per answer


def test_self_spec_options(smollm_path):
    p = run("generate", "--model", str(smollm_path), "--prompt", "Name a colour.", "--max-tokens", "8", "--json",
            "--tier", "ultrafast", "--drafters", "self_spec", "--self-spec-layers", "0-3,20-29")
    assert p.returncode == 0, p.stderr
    assert "self_spec" in json.loads(p.stdout)["drafters"]
    p = run("generate", "--model", str(smollm_path), "--prompt", "x", "--self-spec-layers", "0-99")
    assert p.returncode == 2 and "self-speculation layers" in p.stderr and "Traceback" not in p.stderr


def test_serve_refuses_bad_drafter_options_before_loading(smollm_path):
    for extra, msg in ((["--drafters", "suffix,nope"], "unknown drafter"),
                       (["--drafters", "draft_model"], "needs --draft-model"),
                       (["--draft-model", str(smollm_path), "--model", str(smollm_path)], "exactly one --model")):
        p = run("serve", "--model", str(smollm_path), "--port", "1", *extra)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr

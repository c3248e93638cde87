"""`ultrafast agentbench` end to end on SmolLM2, one short edit: the table, exactness, the JSON and its picture."""

import json
import subprocess
import sys


def test_agentbench_json_and_picture(smollm_path, tmp_path):
    out = tmp_path / "agent.json"
    p = subprocess.run([sys.executable, "-m", "ultrafast.cli", "agentbench", "--model", str(smollm_path),
                        "--iterations", "2", "--max-tokens", "24", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "identical outputs: yes" in p.stdout
    r = json.loads(out.read_text())
    assert len(r["iterations"]) == 2 and r["identical"] is True
    assert all(it["standard_tok_s"] > 0 and it["tau"] >= 1.0 for it in r["iterations"])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "agent loop" in p.stderr  # the progress bar
    # edit by edit, each tier in turn
    notes = [line.split()[0] for line in p.stderr.splitlines() if " iteration " in line]
    assert notes == ["standard", "ultrafast", "standard", "ultrafast"], notes

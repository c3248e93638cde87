"""`ultrafast jsonbench` end to end on SmolLM2, two schemas: validity and exactness per tier, the JSON and its
picture."""

import json
import subprocess
import sys


def test_jsonbench_json_and_picture(smollm_path, tmp_path):
    out = tmp_path / "jb.json"
    p = subprocess.run([sys.executable, "-m", "ultrafast.cli", "jsonbench", "--model", str(smollm_path),
                        "--schemas", "2", "--max-tokens", "96", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    r = json.loads(out.read_text())
    assert len(r["schemas"]) == 2 and r["identical"] == 2, p.stdout
    assert p.returncode == (0 if r["valid"] == 2 else 1)
    assert all(s["ultrafast_tok_s"] > 0 for s in r["schemas"]) and r["mask_ms_per_token"] >= 0
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

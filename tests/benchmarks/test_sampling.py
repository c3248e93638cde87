"""`python -m ultrafast.benchmarks.sampling`: the fused sampling rule against the PyTorch one on a model's logits."""

import pytest

from ultrafast import kernels
from ultrafast.benchmarks.sampling import main, run
from ultrafast.sampler import SamplingParams


@pytest.mark.skipif(not kernels.available(), reason="C++ kernels unavailable")
def test_both_rules_timed_on_the_models_logits(smollm_path, capsys):
    r = run(str(smollm_path), SamplingParams(temperature=0.8, top_p=0.95), reps=20)
    assert r["vocab"] == 49152 and 1 <= r["kept_tokens"] <= r["vocab"]
    assert r["fused_ms"] > 0 and r["torch_ms"] > 0
    assert r["agree"] >= 19  # they differ only on a boundary's rounding
    assert main(["--model", str(smollm_path), "--reps", "5", "--top-k", "40"]) == 0
    assert "PyTorch rule" in capsys.readouterr().out


def test_bad_arguments_are_one_error_line(capsys):
    assert main(["--model", "no-such-model"]) == 2
    assert capsys.readouterr().err.startswith("error:")
    assert main(["--temperature", "0"]) == 2
    assert "greedy" in capsys.readouterr().err
    assert main(["--top-p", "2"]) == 2
    assert capsys.readouterr().err.startswith("error:")

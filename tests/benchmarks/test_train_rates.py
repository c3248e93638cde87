"""`python -m ultrafast.benchmarks.train_rates`: the feature forwards' and the training step's tokens/s."""

import json

from ultrafast.benchmarks.train_rates import main


def test_prints_each_forward_and_precision_and_what_a_run_would_choose(smollm_path, tmp_path, capsys):
    out = tmp_path / "rates.json"
    assert main(["--model", str(smollm_path), "--seq-len", "64", "--sequences", "1", "--precisions", "fp32",
                 "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == got
    assert {"bf16", "packed"} <= set(got["feature_tokens_per_s"]) and all(v > 0 for v in got["feature_tokens_per_s"].values())
    assert list(got["training_tokens_per_s"]) == ["fp32"] and got["training_tokens_per_s"]["fp32"] > 0
    assert got["chosen"]["features"] in got["feature_tokens_per_s"] and got["chosen"]["training"] in ("fp32", "bf16")


def test_bad_options_are_one_error_line(capsys):
    assert main(["--precisions", "fp64"]) == 2
    assert main(["--seq-len", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error:") for line in err)

"""The self-speculation benchmark's measurement: a subset that is every layer agrees everywhere."""

from tests.builders import write_tiny_gguf
from ultrafast.benchmarks.self_spec import agreement, candidate_sets
from ultrafast.engine import Engine


def test_candidate_sets_are_proper_subsets():
    for n in (2, 5, 28, 30):
        sets = candidate_sets(n)
        assert sets and all(0 < len(v) < n and v == sorted(set(v)) and v[-1] < n for v in sets.values())


def test_agreement_of_the_full_model_is_one(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", qtype=0, seed=3)
    engine = Engine.from_path(tmp_path / "t.gguf", max_context=128, device="cpu", packed=True)
    questions = [("qa", "hello there"), ("qa", "what is 2+2?")]
    agree, total = agreement(engine, questions, {"all": [0, 1], "second only": [1]}, tokens=12)
    assert total > 10
    assert agree["all"] == 1.0 and agree["second only"] < 1.0

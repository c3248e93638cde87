import pytest
import torch

from ultrafast.pull import pull

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm_path():
    """The real SmolLM2-135M GGUF, pulled into $ULTRAFAST_HOME on first use (CI pulls it in .ci/run)."""
    return pull("smollm2-135m")


@pytest.fixture(scope="session")
def qwen05_path():
    return pull("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def smollm_engine(smollm_path):
    from ultrafast.engine import Engine

    return Engine.from_path(smollm_path, max_context=1024, device="cpu")


def docstring_conversations() -> list[list[dict]]:
    """Chats about standard-library modules (their docstrings as the answers): text for tiny draft-head runs
    that needs no download."""
    import importlib
    import sys
    import warnings

    out = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in ("antigravity", "this", "idlelib", "turtledemo", "tkinter", "turtle"):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                doc = importlib.import_module(name).__doc__
        except Exception:  # noqa: BLE001 (platform modules that do not import here)
            continue
        if doc and len(doc) > 300:
            out.append([{"role": "user", "content": f"What does the Python module `{name}` do?"},
                        {"role": "assistant", "content": doc.strip()}])
    return out


@pytest.fixture(scope="session")
def tiny_head(smollm_path, tmp_path_factory):
    """A draft head for SmolLM2 trained in seconds (a few thousand tokens): (report, path)."""
    import io

    from ultrafast.training import Recipe, train_draft

    d = tmp_path_factory.mktemp("tiny-head")
    recipe = Recipe(tokens=5000, seq_len=192, epochs=3, depth=2, lr=2e-3, batch_tokens=384, draft_vocab=2048,
                    code_share=0.3, heldout=8, features="bf16")
    report = train_draft(str(smollm_path), recipe, out=d / "head.pt", work_dir=d / "work", stream=io.StringIO(),
                         conversations=docstring_conversations())
    return report, d / "head.pt"


@pytest.fixture
def vnni():
    """The AVX512-VNNI kernels as the path in use (skips on CPUs without them), the default path again after."""
    from ultrafast import kernels

    if not kernels.available() or not kernels.load().vnni_supported():
        pytest.skip("CPU without AVX512-VNNI")
    kernels.set_kernels_path("auto")
    yield
    kernels.set_kernels_path("auto")

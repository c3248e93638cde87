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

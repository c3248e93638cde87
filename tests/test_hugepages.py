"""Weights copied out of the file into one region on transparent huge pages."""

import gc
from pathlib import Path

import pytest
import torch

from ultrafast.hugepages import HUGE_PAGE, copy_to_hugepages, huge_bytes
from ultrafast.loader import load


def _thp_offered() -> bool:
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def test_copies_are_equal_aligned_and_outlive_their_sources():
    g = torch.Generator().manual_seed(0)
    src = [torch.randint(0, 256, (37, 144), dtype=torch.uint8, generator=g), torch.randn(5, 3, generator=g),
           torch.randn(7, generator=g).to(torch.bfloat16), torch.randint(0, 256, (1,), dtype=torch.uint8)]
    keep = [t.clone() for t in src]
    out = copy_to_hugepages(src)
    del src
    gc.collect()
    for a, b in zip(out, keep):
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous() and torch.equal(a, b)
        assert a.data_ptr() % 64 == 0
    assert out[0].data_ptr() % HUGE_PAGE == 0
    out[1].add_(1)  # writable, and separate from the other copies
    assert torch.equal(out[0], keep[0]) and torch.equal(out[1], keep[1] + 1)


@pytest.mark.skipif(not _thp_offered(), reason="transparent huge pages are off on this machine")
def test_copies_get_huge_pages():
    before = huge_bytes()
    out = copy_to_hugepages([torch.ones(24 << 20, dtype=torch.uint8)])
    assert huge_bytes() - before >= 16 << 20
    assert int(out[0].sum()) == 24 << 20


def test_loaded_tensors_live_in_one_region(smollm_path):
    loaded = load(smollm_path)
    ptrs = sorted((t.raw.data_ptr(), t.nbytes) for t in loaded.tensors.values())
    assert ptrs[0][0] % HUGE_PAGE == 0
    for (p, n), (q, _) in zip(ptrs, ptrs[1:]):
        assert q >= p + n and q - (p + n) < 64  # packed one after another, 64-byte aligned


def test_kernel_layouts_live_in_one_region(smollm_path, vnni):
    """The VNNI kernels' layouts of the linears (made at load, streamed by every step) sit in their own region,
    one after another from a 2 MB boundary, like the file's bytes."""
    from ultrafast.engine import Engine
    from ultrafast.packed import PackedLinear

    engine = Engine.from_model(str(smollm_path), max_context=64)
    lins = [m for m in engine.model.modules() if isinstance(m, PackedLinear)]
    ptrs = sorted((m.raw_vnni.data_ptr(), m.raw_vnni.nbytes) for m in lins)
    assert len(ptrs) == len(lins) and all(m.weights(True)[0] is m.raw_vnni for m in lins)  # SmolLM2: all Q4_1, Q8_0
    assert ptrs[0][0] % HUGE_PAGE == 0
    for (p, n), (q, _) in zip(ptrs, ptrs[1:]):
        assert q >= p + n and q - (p + n) < 64

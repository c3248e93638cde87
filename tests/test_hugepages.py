"""Weights on transparent huge pages: what the kernels stream, in one region; the rest stays in the file."""

import gc
from pathlib import Path

import pytest
import torch

from ultrafast.hugepages import HUGE_PAGE, empty_on_hugepages, huge_bytes
from ultrafast.loader import load


def _thp_offered() -> bool:
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def copy_to_hugepages(tensors):
    out = empty_on_hugepages(tensors)
    for dst, t in zip(out, tensors):
        dst.copy_(t)
    return out


def _rss_file_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    return -1


def test_a_tensors_file_pages_are_released_alone(smollm_path):
    """`release_file_pages(t)` unmaps the pages under one tensor (the loader does it a linear at a time, so the file's
    pages and the copies are not all mapped at once); the tensor still reads the same bytes afterwards."""
    loaded = load(smollm_path)
    in_file = sorted((q.raw for q in loaded.tensors.values() if loaded.in_file(q.raw)), key=lambda r: -r.nbytes)
    t, other = in_file[0], in_file[1]  # the largest two (the token embedding, an MLP matrix)
    assert other.nbytes > 200_000
    before = t.clone()
    int(t.sum()), int(other.sum())  # map both
    mapped = _rss_file_bytes()
    if mapped < 0:
        pytest.skip("no /proc/self/status RssFile here")
    loaded.release_file_pages(t)
    assert mapped - _rss_file_bytes() >= 0.9 * t.nbytes
    still = _rss_file_bytes()
    int(other.sum())  # the other tensor's pages were left mapped: reading it maps nothing new
    assert _rss_file_bytes() - still < 0.1 * other.nbytes
    assert torch.equal(t, before)  # read again from the page cache
    loaded.release_file_pages(torch.zeros(4))  # not in the file: nothing happens


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


def test_loaded_tensors_stay_in_the_file(smollm_path):
    """The loader copies nothing but the rows it must reorder (a llama file's Q and K rows, permuted for llama.cpp's
    RoPE): every other GGUF tensor is a view of the file's mapping (page cache)."""
    loaded = load(smollm_path)
    permuted = {n for n in loaded.tensors if ".attention.wq." in n or ".attention.wk." in n}
    assert permuted and loaded.config.arch == "llama"
    assert all(loaded.in_file(t.raw) != (n in permuted) for n, t in loaded.tensors.items())
    assert not loaded.in_file(torch.zeros(4))


@pytest.mark.parametrize("path", ["vnni", "fp32"])
def test_what_the_kernels_stream_lives_in_one_region(smollm_path, path):
    """What every step streams, made at load, sits in one region on huge pages, one linear after another from a 2 MB
    boundary: on the VNNI kernels the linears' own layouts (their file bytes stay in the file), on the fp32 kernels
    copies of the file's bytes. One copy of each linear either way: the model holds about the file's size."""
    from ultrafast import kernels
    from ultrafast.engine import Engine
    from ultrafast.packed import PackedLinear

    if not kernels.available() or (path == "vnni" and not kernels.vnni_supported()):
        pytest.skip(f"no {path} kernels here")
    kernels.set_kernels_path(path)
    try:
        engine = Engine.from_model(str(smollm_path), max_context=64)
        named = [(n, m) for n, m in engine.model.named_modules() if isinstance(m, PackedLinear)]
        lins = [m for _, m in named]
        streamed = [m.weights()[0] for m in lins]
        if path == "vnni":  # SmolLM2: all Q4_1, Q8_0: every one has a layout, its file bytes stay in the file
            assert all(w is m.raw_layout for w, m in zip(streamed, lins))  # (but the loader's permuted Q and K rows)
            assert all(engine.loaded.in_file(m.raw) != (".wq" in n or ".wk" in n) for n, m in named)
        else:
            assert all(w is m.raw and m.raw_layout is None for w, m in zip(streamed, lins))
        assert not any(engine.loaded.in_file(w) for w in streamed)
        ptrs = sorted({(w.data_ptr(), w.nbytes) for w in streamed})
        assert ptrs[0][0] % HUGE_PAGE == 0
        for (p, n), (q, _) in zip(ptrs, ptrs[1:]):
            assert q >= p + n and q - (p + n) < 64
        info = engine.describe()
        # (SmolLM2 is a llama file: its Q and K rows, permuted at load, are also held: ~10% more)
        assert info["weight_bytes_held"] <= 1.15 * info["file_tensor_bytes"]
        assert info["weight_bytes_held"] + info["weight_bytes_in_file"] >= info["file_tensor_bytes"]
        assert (info["weight_bytes_layout"] > 0) == (path == "vnni")
    finally:
        kernels.set_kernels_path("auto")

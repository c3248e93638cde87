"""Weight memory on transparent huge pages.

Decode reads every weight once per token, in long sequential streams. On 4 KB pages that is a TLB miss per
4 KB (~240,000 page walks per token on the 1.5B model) and the hardware prefetchers stop at every page
boundary. Linux backs an anonymous mapping advised with MADV_HUGEPAGE by 2 MB pages when transparent huge
pages are "always" or "madvise" (/sys/kernel/mm/transparent_hugepage/enabled); a file mapping is not (the
page cache stays on 4 KB pages). So the loader places what the kernels stream in one such mapping, aligned
to 2 MB (`empty_on_hugepages`, filled by `packed.py`), and drops the file's pages from the process. On
Qwen2.5-Coder-1.5B Q4_K_M, 2 threads, `python -m ultrafast.benchmarks.hugepages` measures the same bytes on
4 KB pages 1.04-1.07x slower per decode step (and the file mapping this replaced was slower still: 36 against
30 ms, timed with alternating runs).

Where huge pages are not available (another OS, THP "never", no 2 MB page free) the copy is ordinary
memory: the same bytes, only the speed differs. `huge_bytes()` says how much of it the kernel did back with
huge pages.
"""

from __future__ import annotations

import mmap
import os

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line


def _advise_huge(mm: mmap.mmap, start: int, length: int) -> None:
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not hasattr(mm, "madvise") or length <= 0:
        return
    try:
        mm.madvise(advice, start, length)
    except OSError:  # THP compiled out or "never": plain pages
        pass


def empty_on_hugepages(like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors of the dtypes and shapes of `like`, contents unset (zero pages until written), placed one after another
    in one anonymous mapping advised for huge pages, each on a cache line (the first on a 2 MB boundary). The mapping
    lives as long as any of them does."""
    sizes = [t.numel() * t.element_size() for t in like]
    total = sum((n + ALIGN - 1) // ALIGN * ALIGN for n in sizes)
    if total == 0:
        return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like]
    # anonymous and private (Python's default for -1 is shared, i.e. shmem, which THP "madvise" leaves alone)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    mm = mmap.mmap(-1, total + HUGE_PAGE, flags=flags) if flags else mmap.mmap(-1, total + HUGE_PAGE)
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive
    start = (-whole.data_ptr()) % HUGE_PAGE  # the first 2 MB boundary (a multiple of the 4 KB page size)
    _advise_huge(mm, start, total)  # before the first write: the faults then take 2 MB pages
    out, off = [], start
    for t, n in zip(like, sizes):
        out.append(whole[off:off + n].view(t.dtype).view(t.shape))
        off += (n + ALIGN - 1) // ALIGN * ALIGN
    return out


def huge_bytes() -> int | None:
    """Bytes of this process's anonymous memory on transparent huge pages (Linux), else None."""
    try:
        with open(f"/proc/{os.getpid()}/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None

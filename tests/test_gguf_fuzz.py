"""Property-based fuzzing of the GGUF reader and loader (hypothesis): truncated files, overwritten bytes, and
header fields set to oversized, negative (as two's complement), zero or wrong-type values. Whatever the file,
`load` either gives a model or raises ModelLoadError naming the file; never another exception, never a crash.
A file that loads builds a model whose forward runs (the kernels read only what the shapes promise).

`ULTRAFAST_FUZZ_EXAMPLES` sets the examples per property (default 60)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.builders import write_tiny_gguf
from ultrafast import gguf_file
from ultrafast.engine import ContextOverflowError
from ultrafast.loader import ModelLoadError, load
from ultrafast.sampler import SamplingParams

EXAMPLES = int(os.environ.get("ULTRAFAST_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
INTERESTING_U64 = [0, 1, 2, 3, 7, 8, 9, 12, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63,
                   2**64 - 2, 2**64 - 1]


def _fields(data: bytes) -> list[tuple[int, int, str]]:
    """(offset, size, what) of every integer field of the header: counts, string lengths, value types,
    array element types and lengths, tensor dimensions, types and offsets."""
    cur = gguf_file._Cursor(memoryview(data))
    out = []

    def u(size: int, what: str) -> int:
        out.append((cur.pos, size, what))
        return cur.scalar(4 if size == 4 else 10)

    def string(what: str) -> None:
        n = u(8, f"{what} length")
        cur.take(n)

    def value(vtype: int, what: str) -> None:
        if vtype in gguf_file._SCALARS:
            cur.scalar(vtype)
        elif vtype == gguf_file.STRING:
            string(what)
        else:
            etype, n = u(4, f"{what} element type"), u(8, f"{what} length")
            for i in range(n):
                value(etype, f"{what}[{i}]") if etype in (gguf_file.STRING, gguf_file.ARRAY) else cur.scalar(etype)

    cur.take(4)
    u(4, "version")
    n_tensors, n_kv = u(8, "tensor count"), u(8, "metadata count")
    for _ in range(n_kv):
        start = cur.pos
        string("key")
        key = str(data[start + 8:cur.pos], "utf-8")
        value(u(4, f"{key} type"), key)
    for _ in range(n_tensors):
        string("tensor name")
        n_dims = u(4, "n_dims")
        for d in range(n_dims):
            u(8, f"dim {d}")
        u(4, "tensor type")
        u(8, "tensor offset")
    return out


class _Tiny(tuple):
    def __repr__(self) -> str:  # hypothesis prints its arguments: not the megabytes
        return f"<tiny GGUF {self[0]}>"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, bytes, list]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    data = path.read_bytes()
    # the many per-token entries of the vocabulary add nothing the first few do not
    fields = [f for f in _fields(data) if "[" not in f[2] or f[2].endswith("[0]]") or "[1]" in f[2]]
    return _Tiny((path, data, fields))


def _check(tmp: Path, data: bytes) -> None:
    """load() of these bytes: a model whose forward runs, or a ModelLoadError naming the file."""
    path = tmp / "fuzzed.gguf"
    path.write_bytes(data)
    try:
        loaded = load(path)
    except ModelLoadError as e:
        assert "fuzzed.gguf" in str(e), e
        return
    from ultrafast import kernels
    from ultrafast.engine import Engine
    from ultrafast.model import build_model
    from ultrafast.packed import apply_packed

    # the packed kernels where they build (the default path): they read exactly what the checked shapes promise
    engine = Engine(loaded, build_model(loaded, "cpu", apply_packed if kernels.available() else None),
                    max_context=32)
    try:
        r = engine.generate([1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    except ContextOverflowError:  # a context of under 3 tokens: the prompt is refused, cleanly
        assert loaded.config.context_length <= 2
        return
    assert 1 <= len(r.token_ids) <= 2 and all(0 <= t < loaded.config.vocab_size for t in r.token_ids)


def test_the_unmodified_file_loads(tiny, tmp_path):
    _check(tmp_path, tiny[1])
    assert len(tiny[2]) > 40  # the header walk found the fields the mutations aim at


@FUZZ
@given(frac=st.floats(0, 1, exclude_max=True))
def test_truncated(tiny, tmp_path, frac):
    data = tiny[1]
    _check(tmp_path, data[:int(frac * len(data))])


@FUZZ
@given(which=st.integers(0, 10**6), value=st.one_of(st.sampled_from(INTERESTING_U64), st.integers(0, 2**64 - 1)))
def test_header_field_set_to_an_odd_value(tiny, tmp_path, which, value):
    _, data, fields = tiny
    off, size, _what = fields[which % len(fields)]
    value %= 1 << (8 * size)
    _check(tmp_path, data[:off] + value.to_bytes(size, "little") + data[off + size:])


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 255)), min_size=1, max_size=8),
       head=st.booleans())
def test_overwritten_bytes(tiny, tmp_path, edits, head):
    data = bytearray(tiny[1])
    limit = tiny[2][-1][0] + 8 if head else len(data)  # the header, or anywhere
    for pos, byte in edits:
        data[pos % limit] = byte
    _check(tmp_path, bytes(data))


@FUZZ
@given(which=st.integers(0, 1000),
       vtype=st.sampled_from([0, 1, 4, 5, 6, 7, 8, 10, 11, 12]),
       value=st.one_of(st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True), st.text(max_size=8)))
def test_metadata_of_the_wrong_type_or_range(tiny, tmp_path, which, vtype, value):
    """A key (any of the file's) re-encoded with another value type or out of range: a count as a string, a
    float, NaN, a negative or huge number, the vocabulary as a scalar."""
    _, data, _ = tiny
    keys = sorted(gguf_file.read(tiny[0])[0])
    key = keys[which % len(keys)]
    enc = _encode(vtype, value)
    if enc is None:
        return
    _check(tmp_path, _replace_value(data, key, vtype, enc))


def _encode(vtype: int, value) -> bytes | None:
    if vtype == gguf_file.STRING:
        b = str(value).encode("utf-8", "surrogatepass")
        return struct.pack("<Q", len(b)) + b
    fmt = gguf_file._SCALARS[vtype]
    try:
        v = value
        if fmt[-1] in "BbHhIiQq":
            v = int(value) if not isinstance(value, str) and value == value and abs(value) != float("inf") else 0
            bits = 8 * struct.calcsize(fmt)
            v = v % (1 << bits)
            if fmt[-1].islower():
                v = v - (1 << bits) if v >= 1 << (bits - 1) else v
        elif fmt[-1] in "fd":
            v = float(value) if not isinstance(value, str) else 0.5
        elif fmt[-1] == "?":
            v = bool(value)
        return struct.pack(fmt, v)
    except (OverflowError, struct.error):
        return None


def _replace_value(data: bytes, key: str, vtype: int, enc: bytes) -> bytes:
    """The file with metadata `key`'s type and value replaced (the rest of the header shifts along)."""
    cur = gguf_file._Cursor(memoryview(data))
    cur.take(4 + 4)
    n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
    for _ in range(n_kv):
        k = cur.string()
        tpos = cur.pos
        cur.value(cur.scalar(4))
        if k == key:
            return data[:tpos] + struct.pack("<I", vtype) + enc + data[cur.pos:]
    raise AssertionError(f"{key} not in the file")

"""The sandbox with hostile candidates: each is contained (stopped or refused), costs at most its time limit,
leaves nothing behind, and the next run goes on."""

from __future__ import annotations

import os
import time

import pytest

from ultrafast.evals.sandbox import Limits, Sandbox


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(Limits(seconds=2, memory_mb=512, file_mb=8))


def test_a_passing_and_a_failing_program(sandbox):
    ok = sandbox.run("import math\nassert math.gcd(12, 18) == 6\nopen('note.txt', 'w').write('scratch is fine')")
    assert ok.passed, ok.detail
    bad = sandbox.run("def f():\n    return 1\nassert f() == 2, 'wrong answer'")
    assert bad.status == "failed" and "wrong answer" in bad.detail


@pytest.mark.parametrize("name, code, status, says", [
    ("infinite loop", "while True:\n    pass", "timeout", "time limit"),
    ("fork bomb", "import os\nwhile True:\n    os.fork()", "failed", "os.fork"),
    ("10 GB allocation", "x = bytearray(10 * 1024 ** 3)", "failed", "MemoryError"),
    ("a file past the size limit", "open('big', 'wb').write(b'x' * (64 << 20))", "failed", "File too large"),
    ("filling the disk", "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * (4 << 20))\n    i += 1",
     "disk", "scratch directory"),
    ("a socket", "import socket\nsocket.create_connection(('127.0.0.1', 9))", "failed", "sandbox"),
    ("a subprocess", "import subprocess\nsubprocess.run(['true'])", "failed", "sandbox"),
    ("os.system", "import os\nos.system('true')", "failed", "os.system"),
    ("ctypes", "import ctypes\nctypes.CDLL(None)", "failed", "sandbox"),
])
def test_hostile_candidates_are_contained(sandbox, name, code, status, says):
    t0 = time.monotonic()
    out = sandbox.run(code)
    assert out.status == status, (name, out)
    assert says in out.detail, (name, out.detail)
    assert time.monotonic() - t0 < sandbox.limits.seconds + 3  # its time limit, and nothing more
    assert sandbox.run("pass").passed  # the next run goes on


def test_nothing_is_written_outside_the_scratch_directory(sandbox, tmp_path):
    target = tmp_path / "escaped.txt"
    for code in (f"open({str(target)!r}, 'w').write('x')", f"import os\nos.open({str(target)!r}, os.O_CREAT | os.O_WRONLY)",
                 f"import shutil\nshutil.rmtree({str(tmp_path)!r})", f"import os\nos.rename('candidate.py', {str(target)!r})"):
        out = sandbox.run(code)
        assert out.status == "failed" and "outside the scratch directory" in out.detail, out
    assert tmp_path.exists() and not target.exists()
    out = sandbox.run("import os, sys\nopen('left.txt', 'w').write('x')\nsys.exit(os.getcwd())")
    scratch = out.detail.splitlines()[-1]
    assert out.status == "failed" and "ultrafast-sandbox-" in scratch and not os.path.exists(scratch)


def test_isolation_is_reported(sandbox):
    text = sandbox.isolation()
    assert "audit hook" in text and "rlimits" in text

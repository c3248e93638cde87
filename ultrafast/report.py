"""What the benchmark and eval verbs leave behind: their figures as JSON, a picture beside it, and a progress
bar with an ETA while they run.

Each verb draws its own picture (its module's `plot`) through `figure`; `write` puts the JSON at the path the
user gave and the PNG next to it (same name, `.png`)."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

TIER_COLOURS = {"standard": "tab:blue", "ultrafast": "tab:orange", "llama.cpp": "tab:gray"}


def png_beside(json_path: str | Path) -> Path:
    return Path(json_path).with_suffix(".png")


@contextmanager
def figure(path: Path, *, ncols: int = 1, size: tuple[float, float] = (6.4, 4.2)):
    """A matplotlib figure (headless backend) with `ncols` axes, saved to `path` when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=size, dpi=120)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def write(json_path: str | None, obj, plot: Callable[[Path], None] | None = None, *, log=sys.stderr) -> Path | None:
    """The figures as JSON at `json_path` ('-': stdout, None: nowhere) and, given `plot(png_path)`, the picture
    beside it. Returns the PNG's path, if one was drawn."""
    if json_path is None:
        return None
    text = json.dumps(obj, indent=2)
    if json_path == "-":
        print(text)
        return None
    Path(json_path).write_text(text + "\n")
    png = None
    if plot is not None:
        png = png_beside(json_path)
        plot(png)
    print(f"figures: {json_path}" + (f"; picture: {png}" if png else ""), file=log)
    return png


class Progress:
    """A progress bar with rate and ETA on `file` (tqdm), and lines printed above it; silent without a file."""

    def __init__(self, total: int, desc: str, unit: str, file=sys.stderr):
        from tqdm import tqdm

        self.file = file
        self.bar = tqdm(total=total, desc=desc, unit=unit, file=file, dynamic_ncols=True, disable=file is None)

    def update(self, n: int = 1, **postfix) -> None:
        if postfix:
            self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(n)

    def note(self, line: str) -> None:
        if self.file is not None:
            self.bar.write(line, file=self.file)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

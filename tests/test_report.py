"""What benchmark verbs leave behind: JSON at the given path, a picture beside it, a silent bar without a file."""

import io
import json

from ultrafast import report


def test_write_json_and_png(tmp_path):
    drawn = []

    def plot(png):
        with report.figure(png) as (fig, ax):
            ax.plot([1, 2], [3, 4])
        drawn.append(png)

    png = report.write(str(tmp_path / "x.json"), {"a": 1}, plot, log=io.StringIO())
    assert png == tmp_path / "x.png" == drawn[0] and png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": 1}
    assert report.write(None, {"a": 1}, plot) is None and len(drawn) == 1


def test_write_to_stdout_draws_nothing(capsys):
    assert report.write("-", {"b": [1, 2]}, lambda png: 1 / 0) is None
    assert json.loads(capsys.readouterr().out) == {"b": [1, 2]}


def test_progress_lines_and_eta():
    buf = io.StringIO()
    with report.Progress(3, "work", "item", file=buf) as bar:
        bar.note("first line")
        bar.update(2, tau="1.5")
    text = buf.getvalue()
    assert "first line" in text and "work" in text and "2/3" in text and "tau=1.5" in text
    silent = report.Progress(3, "work", "item", file=None)
    silent.note("nothing")
    silent.update(1)
    silent.close()

"""The server an eval talks to: the one at `--url`, or an `ultrafast serve` started for the run on a free
loopback port (and stopped after it), with enough slots for the run's candidates to decode together."""

from __future__ import annotations

import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import httpx

from ..server.process import ServeProcess, sigterm_as_interrupt, wait_healthy


def _model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"]
    return models[0]["id"]


def check_args(args) -> None:
    """The options that only a server started for the run takes: an error with --url."""
    if args.url and getattr(args, "activation_bits", None) is not None:
        raise ValueError("--activation-bits sets the server started for the run; the one at --url runs with its "
                         "own (`ultrafast serve --activation-bits`)")


@contextmanager
def served(args, slots: int):
    """(base URL of the OpenAI API, the model's name): `args.url`'s server, or one started for the run from
    `args.model` (`args.max_context`, `args.threads`)."""
    with sigterm_as_interrupt():  # `kill` ends the run as Ctrl-C does: its results so far, the server stopped
        if args.url:
            url = args.url.rstrip("/")
            url = url[:-3] if url.endswith("/v1") else url
            wait_healthy(url, None, 30)
            yield url + "/v1", _model(url, args.api_key)
        else:
            with _started(args, slots) as got:
                yield got


@contextmanager
def _started(args, slots: int):
    tmp = Path(tempfile.mkdtemp(prefix="ultrafast-evals-"))
    chosen = ["--model", args.model, "--slots", str(slots)]  # what the run's options chose (printed)
    if getattr(args, "threads", None):
        chosen += ["--threads", str(args.threads)]
    if getattr(args, "activation_bits", None):
        chosen += ["--activation-bits", str(args.activation_bits)]
    cmd = chosen + ["--db", str(tmp / "ledger.db"), "--max-queue", str(max(64, 4 * slots)), "--max-context",
                    str(args.max_context), "--log-level", "warning"]
    server = ServeProcess(cmd, tmp / "server.log")
    print(f"starting `ultrafast serve {' '.join(chosen)}` on port {server.port} (log {server.log})", file=sys.stderr)
    server.start()
    try:
        yield server.url + "/v1", _model(server.url, None)
    finally:
        server.stop()

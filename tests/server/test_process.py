"""`ultrafast/server/process.py`: what the evals and the cluster run their servers with."""

from __future__ import annotations

import os
import signal

import pytest

from ultrafast.server.process import sigterm_as_interrupt


def test_sigterm_interrupts_inside_and_the_old_handler_comes_back():
    seen = []
    old = signal.signal(signal.SIGTERM, lambda *_: seen.append("old"))
    try:
        with pytest.raises(KeyboardInterrupt):
            with sigterm_as_interrupt():
                os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next line
                seen.append("not interrupted")
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == ["old"]
    finally:
        signal.signal(signal.SIGTERM, old)

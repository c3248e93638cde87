"""The race page at `/`, in a real browser: headless Chromium (Debian's `chromium`) driven by Playwright loads it
from a real server, races a prompt in both tiers, and reads what a user would read.

Skipped when no Chromium or no Playwright is found, unless $ULTRAFAST_REQUIRE_BROWSER is set (CI: `.ci/run`
installs Debian's chromium and sets it). The screenshot goes to $ULTRAFAST_TEST_ARTIFACTS (default
build/test-artifacts)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

from ultrafast.server.auth import KeyStore
from ultrafast.server.db import Database

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Write a Python function that returns the larger of two numbers."
MAX_TOKENS = 40


def _chromium() -> str:
    exe = os.environ.get("ULTRAFAST_TEST_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    why = None
    if exe is None:
        why = "no Chromium (Debian: apt-get install chromium; or set $ULTRAFAST_TEST_CHROMIUM)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            why = "no Playwright for Python (pip install playwright)"
    if why:
        if os.environ.get("ULTRAFAST_REQUIRE_BROWSER"):
            pytest.fail(f"a browser is required here ($ULTRAFAST_REQUIRE_BROWSER) but unavailable: {why}")
        pytest.skip(why)
    return exe


@pytest.fixture(scope="module")
def browser():
    exe = _chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True)
        yield b
        b.close()


def _page(browser):
    # bypass_csp: the page's own policy forbids eval, which Playwright's wait_for_function uses
    ctx = browser.new_context(viewport={"width": 1280, "height": 1000}, bypass_csp=True)
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    return page, errors


def _wait_text(page, selector: str, pattern: str, timeout_ms: int = 180_000) -> str:
    page.wait_for_function("([s, p]) => new RegExp(p).test(document.querySelector(s).textContent)",
                           arg=[selector, pattern], timeout=timeout_ms)
    return page.text_content(selector)


@pytest.fixture(scope="module")
def local(server_factory):
    return server_factory(None)


def test_page_is_static_and_strict(local):
    srv = local
    r = httpx.get(srv.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert '<script src="/static/race.js"' in r.text
    js = httpx.get(srv.url + "/static/race.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    missing = httpx.get(srv.url + "/static/nope.js")
    assert missing.status_code == 404 and "/static/nope.js" in missing.json()["error"]["message"]


def test_local_mode_needs_no_key(local, browser):
    srv = local
    page, errors = _page(browser)
    page.goto(srv.url + "/")
    page.wait_for_function("document.getElementById('model').options.length > 0", timeout=30_000)
    assert page.input_value("#model") == httpx.get(srv.base_url + "/models").json()["data"][0]["id"]
    assert "$" in page.text_content("#ultrafast-price")
    assert page.text_content("#m-error") == ""
    assert not errors, errors


def test_race_in_a_browser(server_factory, browser):
    """With keys required: refused without the key; with it, both tiers stream the same greedy text, which is
    what the API returns for the request, and the figures and the server panel fill in."""
    db = str(server_factory.tmp / "page.db")
    key = KeyStore(Database(db)).create("page", "standard,ultrafast")[0]
    srv = server_factory(db, "--require-keys", "--slots", "2")
    page, errors = _page(browser)
    page.goto(srv.url + "/")
    assert "API key" in _wait_text(page, "#m-error", r"\S", 30_000)  # /metrics refused: no key given
    page.fill("#key", key)
    page.dispatch_event("#key", "change")
    page.wait_for_function("document.getElementById('model').options.length > 0", timeout=30_000)
    page.fill("#prompt", PROMPT)
    page.fill("#max-tokens", str(MAX_TOKENS))
    page.click("#run")
    match = _wait_text(page, "#match", r"\S")
    assert "identical text in both tiers" in match, match
    std, fast = page.text_content("#standard-text"), page.text_content("#ultrafast-text")
    assert std == fast and std.strip()

    api = httpx.post(srv.base_url + "/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                     json={"model": page.input_value("#model"), "temperature": 0, "max_tokens": MAX_TOKENS,
                           "messages": [{"role": "user", "content": PROMPT}]}).json()
    assert api["choices"][0]["message"]["content"] == std

    for tier in ("standard", "ultrafast"):
        assert re.fullmatch(r"\d+\.\d\d s", page.text_content(f"#{tier}-ttft"))
        tokens = int(page.text_content(f"#{tier}-tokens"))
        assert 0 < tokens <= MAX_TOKENS + 1
        assert float(page.text_content(f"#{tier}-tps")) > 0
        assert float(page.text_content(f"#{tier}-tau")) >= 1.0
        assert page.text_content(f"#{tier}-cost").startswith("$")
        assert page.text_content(f"#{tier}-status").startswith("done in")
    # the panel polls /metrics each second: both tiers' requests and spend appear
    _wait_text(page, "#m-standard-requests", r"^[1-9]", 10_000)
    _wait_text(page, "#m-ultrafast-requests", r"^[1-9]", 10_000)
    assert float(_wait_text(page, "#m-ultrafast-tau", r"\d", 10_000)) >= 1.0
    assert page.text_content("#m-ultrafast-spend").startswith("$")
    assert int(page.text_content("#m-standard-tokens")) >= tokens - 1

    out = Path(os.environ.get("ULTRAFAST_TEST_ARTIFACTS", ROOT / "build" / "test-artifacts"))
    out.mkdir(parents=True, exist_ok=True)
    shot = out / "race-page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    assert not [e for e in errors if "401" not in e], errors  # the refused /metrics before the key is expected

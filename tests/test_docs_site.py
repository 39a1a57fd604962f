"""The documentation site as a reader sees it: build/docs in a real headless Chromium.

``make docs`` (tools/docs_site.py) builds the site; ``make test`` builds it after the suite
ran the tutorials, then runs this test. The site is served on 127.0.0.1 by Python's
http.server (the search page loads its index with a request, as it does on a web server),
and Debian's Chromium (never a downloaded browser) opens: the entry page, the API page of
``nbrpc.init``, a tutorial with the plot its nbval run drew, and a search for "device map".
A screenshot of each goes to ``test-artifacts/docs-site/`` (git-ignored). Run alone, the
test builds a missing site first (``make docs``; it runs the tutorials when their executed
copies are missing).
"""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "build" / "docs"
ARTIFACTS = ROOT / "test-artifacts" / "docs-site"
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
#: the tutorial whose plot the test looks for (matplotlib's inline PNG, from plt.show())
PLOT_TUTORIAL = "notebooks/03_parameter_server.html"

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason=f"no {CHROMIUM}: install Debian's chromium (`make test` does it: apt-get install "
    "chromium)",
)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # no request lines in the test's output


@pytest.fixture(scope="module")
def site():
    """build/docs served on loopback (a free port): its base URL."""
    if not (SITE / "index.html").exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "docs_site.py")], check=True)
    handler = functools.partial(_Quiet, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="docs-site-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser, site):
    """A fresh page; it fails the test on any request to another host (the site must work
    offline) and on any JavaScript error."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    outside: list[str] = []
    errors: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(site) else outside.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        yield page
        assert not outside, f"the site asked other hosts: {outside}"
        assert not errors, f"JavaScript errors: {errors}"
    finally:
        context.close()


def test_the_entry_page_leads_to_guides_tutorials_and_reference(page, site):
    page.goto(f"{site}/index.html")
    assert page.title().startswith("nbrpc"), page.title()
    links = page.locator("article a.reference.internal")
    hrefs = {links.nth(i).get_attribute("href") for i in range(links.count())}
    tutorials = {h for h in hrefs if h and h.startswith("notebooks/")}
    assert len(tutorials) == 10, sorted(tutorials)
    for page_name in ("architecture.html", "api/index.html", "magics/index.html", "site.html"):
        assert page_name in hrefs, (page_name, sorted(hrefs))
    page.screenshot(path=str(ARTIFACTS / "index.png"))


def test_the_api_page_of_init_shows_its_signature_and_docstring(page, site):
    page.goto(f"{site}/api/nbrpc.init.html")
    signature = page.locator("dt.sig#nbrpc\\.init")
    assert signature.is_visible()
    text = " ".join(signature.inner_text().split())
    assert text.startswith("nbrpc.init("), text
    assert "n: int | None = None" in text, text
    assert "**options" in text, text
    assert "Cluster" in text, text  # the return annotation, linked to its page
    assert page.locator("dt.sig#nbrpc\\.init a[href^='nbrpc.Cluster.html']").count() >= 1
    body = page.locator("dl.py.function dd").first.inner_text()
    assert "Start n workers" in body, body[:300]
    assert "--device-map" in body, body[:300]  # the options, from nbrpc/_options.py
    page.screenshot(path=str(ARTIFACTS / "api-init.png"))


def test_a_tutorial_shows_the_plot_its_nbval_run_drew(page, site):
    page.goto(f"{site}/{PLOT_TUTORIAL}")
    plot = page.locator(".cell_output img").first
    plot.scroll_into_view_if_needed()
    plot.wait_for(state="visible")
    width = page.evaluate("img => img.complete ? img.naturalWidth : 0", plot.element_handle())
    assert width > 200, f"the plot did not load (naturalWidth {width})"
    assert plot.get_attribute("src").startswith("../_images/"), plot.get_attribute("src")
    outputs = page.locator(".cell_output").all_inner_texts()
    assert any("epoch 0 (1 trainers): loss on all data" in t for t in outputs), outputs[:5]
    page.screenshot(path=str(ARTIFACTS / "tutorial-plot.png"))


def test_a_search_for_device_map_finds_pages(page, site):
    page.goto(f"{site}/search.html?q=device+map")
    results = page.locator("#search-results ul.search li")
    results.first.wait_for(state="visible", timeout=30_000)
    # Sphinx adds the results one by one (each page's text fetched first), then says so:
    # read them all only then (a first read got 6 of them, the options page not yet among)
    summary = page.locator("#search-results p.search-summary")
    summary.filter(has_text="Search finished").wait_for(timeout=30_000)
    found = results.all_inner_texts()
    assert len(found) >= 3, found
    hrefs = [
        results.nth(i).locator("a").first.get_attribute("href") for i in range(results.count())
    ]
    assert any("options" in h for h in hrefs), hrefs  # --device-map's documentation
    assert any("magics/rpc_init" in h for h in hrefs), hrefs
    page.screenshot(path=str(ARTIFACTS / "search-device-map.png"))

"""The playground in a real headless Chromium (Debian's ``chromium``, driven by Playwright):
documents in, the answer streams, a citation click highlights its quote, the kept-token
heat map renders, and the screenshot is a real picture. Checked on the page, not by eye."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import pytest

from tests.api_helpers import running_server

pytestmark = pytest.mark.model
SAMPLES = Path(__file__).parents[1] / "ragsnap" / "samples"
KEY = "playground-test-key"
ROSETTA = (SAMPLES / "rosetta_stone.md").read_text()
TIDES = (SAMPLES / "tides.md").read_text()


def chromium_path() -> str:
    """The system Chromium (``RAGSNAP_CHROMIUM`` or ``chromium`` on PATH). Missing, the
    test fails: CI installs it (``.ci/run``), so a skip would hide a broken setup."""
    path = os.environ.get("RAGSNAP_CHROMIUM") or shutil.which("chromium")
    if not path:
        pytest.fail("no chromium: apt-get install chromium (or set RAGSNAP_CHROMIUM)")
    return path


@pytest.fixture(scope="module")
def base_url(engine, tmp_path_factory):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings

    corpus = tmp_path_factory.mktemp("corpus")
    (corpus / "moon.md").write_text("The Moon pulls on the oceans, which raises the tides.")
    settings = Settings(
        api_keys=KEY, corpus_dir=str(corpus), cache_url="none", max_new_tokens_limit=64
    )
    with running_server(create_app(settings, engine=engine)) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=["--no-sandbox"]
        )
        yield launched
        launched.close()


@pytest.fixture
def page(browser, base_url):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    opened = context.new_page()
    opened.requests = []  # every URL the page asked for
    opened.on("request", lambda request: opened.requests.append(request.url))
    opened.problems = []  # uncaught exceptions, console errors (a CSP violation is one)
    opened.on("pageerror", lambda error: opened.problems.append(str(error)))
    opened.on(
        "console",
        lambda message: message.type == "error" and opened.problems.append(message.text),
    )
    opened.goto(f"{base_url}/")
    yield opened
    context.close()


def test_documents_in_answer_streams_citation_highlights_heat_map_renders(page, base_url):
    page.fill("#api-key", KEY)
    first = page.locator(".document").nth(0)
    first.locator(".doc-title").fill("The Rosetta Stone")
    first.locator(".doc-text").fill(ROSETTA)
    page.click("#add-document")
    second = page.locator(".document").nth(1)
    second.locator(".doc-title").fill("Tides")
    second.locator(".doc-text").fill(TIDES)
    page.fill("#question", "Where is the Rosetta Stone kept?")
    page.select_option("#press", "snapkv")
    page.fill("#budget", "128")
    page.fill("#max-tokens", "32")
    # record the answer's length at every change while it streams
    page.evaluate(
        """() => {
            window.lengths = [];
            const answer = document.getElementById("answer");
            new MutationObserver(() => {
                if (answer.dataset.state === "streaming") window.lengths.push(answer.textContent.length);
            }).observe(answer, {childList: true, characterData: true, subtree: true});
        }"""
    )
    page.click("#ask")
    page.wait_for_selector('#answer[data-state="done"]', timeout=120_000)
    assert page.locator("#error").is_hidden()

    # the answer streamed: it grew over several updates before the done event
    lengths = page.evaluate("window.lengths")
    growing = [n for n in lengths if n > 0]
    assert len(set(growing)) >= 3 and growing == sorted(growing)
    answer = page.inner_text("#answer")
    assert answer.strip() and len(answer) >= growing[-1] - 2

    # cache status and timings from the done event
    assert page.inner_text('#stats dd[data-stat="cache"]') == "off"
    assert page.inner_text('#stats dd[data-stat="press"]') == "snapkv"
    assert page.inner_text('#stats dd[data-stat="total"]').endswith(" ms")

    # a citation click highlights its best quote, at the cited offsets
    cite = page.locator('.citation .cite[data-doc-id="1"]')
    assert cite.count() == 1, page.inner_text("#citations")
    quote = page.locator('.citation .quote[data-doc-id="1"]').first
    start, end = int(quote.get_attribute("data-start")), int(quote.get_attribute("data-end"))
    cite.click()
    mark = page.locator('.doc-view[data-doc-id="1"] mark.quote-highlight')
    assert mark.count() == 1
    assert mark.text_content() == ROSETTA[start:end] == quote.inner_text().strip("“”")
    assert (int(mark.get_attribute("data-start")), int(mark.get_attribute("data-end"))) == (
        start,
        end,
    )
    assert "active" in (quote.get_attribute("class") or "")
    assert page.locator("mark.quote-highlight").count() == 1  # one highlight at a time

    # the heat map: every document's tokens shaded by their kept share, kept and dropped
    for doc_id, text in [("1", ROSETTA), ("2", TIDES)]:
        view = page.locator(f'.doc-view[data-doc-id="{doc_id}"]')
        assert view.locator(".doc-text-view").text_content() == text  # nothing lost or added
        tokens = view.locator(".tok")
        assert tokens.count() > 50
    summary = page.evaluate(
        """() => {
            const toks = [...document.querySelectorAll(".doc-view .tok")];
            return {
                kept: toks.filter(t => t.classList.contains("kept")).length,
                dropped: toks.filter(t => t.classList.contains("dropped")).length,
                colours: new Set(toks.map(t => getComputedStyle(t).backgroundColor)).size,
                shares: new Set(toks.map(t => t.dataset.share)).size,
            };
        }"""
    )
    assert summary["kept"] > 0 and summary["dropped"] > 0, summary
    assert summary["colours"] >= 5 and summary["shares"] >= 5, summary

    # the screenshot is a picture, not a blank page
    from PIL import Image

    png = page.screenshot(full_page=True)
    if folder := os.environ.get("RAGSNAP_SCREENSHOT_DIR"):  # to look at it (CI artifacts)
        Path(folder, "playground.png").write_bytes(png)
    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.width >= 1280 and image.height >= 900
    colours = image.getcolors(maxcolors=1_000_000)
    assert colours is not None and len(colours) > 50
    assert max(count for count, _ in colours) < 0.9 * image.width * image.height

    # nothing came from anywhere but this server, and nothing went wrong on the page
    assert page.requests and all(url.startswith(base_url) for url in page.requests)
    assert page.problems == []


def test_corpus_search_and_upload_add_documents_and_the_key_is_asked_for(page):
    page.wait_for_selector("#search-box", state="visible")  # once /readyz named a corpus
    page.fill("#search-query", "moon tides")
    page.click("#search-button")
    page.wait_for_selector("#error:not([hidden])")
    assert "API key" in page.inner_text("#error")  # no key typed yet: the API said 401

    page.fill("#api-key", KEY)
    assert page.evaluate("sessionStorage.getItem('ragsnap.apiKey')") == KEY
    page.click("#search-button")
    page.wait_for_selector("#search-results .passage")
    assert page.locator("#error").is_hidden()
    page.locator("#search-results .add-passage").first.click()
    added = page.locator(".document").last
    assert added.locator(".doc-text").input_value().startswith("The Moon pulls")

    # an uploaded file becomes a document titled by its name
    upload = {"name": "notes.txt", "mimeType": "text/plain", "buffer": b"Uploaded: the tides."}
    page.set_input_files("#upload", files=[upload])
    # a locator wait: wait_for_function polls with eval, which the page's CSP refuses
    page.locator(".document").nth(2).wait_for()
    assert page.locator(".document").count() == 3
    uploaded = page.locator(".document").last
    assert uploaded.locator(".doc-title").input_value() == "notes.txt"
    assert uploaded.locator(".doc-text").input_value() == "Uploaded: the tides."
    # the one console error is the refused request's 401
    assert len(page.problems) == 1 and "401" in page.problems[0], page.problems

"""The playground shows the verdict (issue 43) in a real headless Chromium, on a tiny
random model whose answer no document backs: the sentence is marked unsupported, the
citation says what its quotes lack, the verdict names what the documents never mention
(session 27's named gate), and with abstain the abstention shows over the model's own
answer."""

from __future__ import annotations

import pytest

from ragsnap.citations.lift import LiftRule
from tests.api_helpers import running_server
from tests.test_playground_browser import chromium_path
from tests.tiny_models import tiny_engine

KEY = "playground-verdict-key"


@pytest.fixture(scope="module", params=["flag", "abstain"])
def served(request):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings

    settings = Settings(api_keys=KEY, cache_url="none", unsupported=request.param)
    engine = tiny_engine("llama", "sdpa", seed=4)
    engine.citing.lift_rule = LiftRule(0.0, 0.0, 0.0, 5.0, 1.0, named_gate=True)
    with running_server(create_app(settings, engine=engine)) as url:
        yield request.param, url


def test_unsupported_sentences_and_the_verdict_show_on_the_page(served):
    from playwright.sync_api import sync_playwright

    mode, url = served
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=["--no-sandbox"]
        )
        page = browser.new_page()
        problems: list[str] = []
        page.on("pageerror", lambda error: problems.append(str(error)))
        page.goto(f"{url}/")
        page.fill("#api-key", KEY)
        first = page.locator(".document").nth(0)
        first.locator(".doc-title").fill("Tides")
        first.locator(".doc-text").fill("The Moon's gravity causes the tides.")
        page.fill("#question", "What causes the tides on Europa?")
        page.fill("#max-tokens", "6")
        page.click("#ask")
        page.wait_for_selector('#answer[data-state="done"]', timeout=120_000)
        verdict = page.locator("#verdict")
        assert verdict.get_attribute("data-grounded") == "false"
        assert verdict.inner_text().startswith("grounded: no")
        assert verdict.inner_text().endswith("the documents never mention Europa")
        marked = page.locator("#answer mark.unsupported")
        assert marked.count() == 1 and marked.inner_text().strip()
        answer = page.inner_text("#answer")
        if mode == "abstain":
            assert answer.startswith("The documents do not answer this.")
            assert "the model answered: " + marked.inner_text() in answer
        else:
            assert answer == marked.inner_text()
        citations = page.inner_text("#citations")
        assert "unsupported" in citations
        assert not problems, problems
        browser.close()

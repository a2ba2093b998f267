"""The web console in a real browser: Debian's headless Chromium driven by Selenium,
against a real ``ratchet serve`` (tokens on) whose Runs run on Ray.

Every wait is on a condition of the page with a deadline (WebDriverWait). Without
``/usr/bin/chromium`` and ``/usr/bin/chromedriver`` the tests skip, unless ``CI=true``
(then they fail). ``RATCHET_CONSOLE_SCREENSHOT=docs/console.png`` also saves the
awaiting thread page there (the README's picture).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx2
import pytest
import ray
from selenium import webdriver
from selenium.common.exceptions import (
    NoSuchElementException,
    StaleElementReferenceException,
    TimeoutException,
)
from selenium.webdriver.chrome.service import Service as ChromeService
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from cluster.client import Ratchet
from edge.console import CSP
from edge.options import ServeOptions
from tests.ray.conftest import ray_session  # noqa: F401  (the session's Ray)
from tests.support.servers import free_port

from .server import ServerThread

pytestmark = pytest.mark.ray
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SCREENSHOT_ENV = "RATCHET_CONSOLE_SCREENSHOT"
TOKEN = f"tok-{uuid.uuid4().hex}"
PERMISSION = "tests.ray.agents:permission_agent"
QUICK = "tests.ray.agents:quick_agent"
LONG_NAP = "tests.ray.agents:long_napping_agent"
WAIT_S = 30


@dataclass(frozen=True)
class Console:
    url: str
    browser: webdriver.Chrome
    http: httpx2.Client

    def open(self, path: str) -> None:
        self.browser.get(self.url + path)

    def until(self, condition: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
        """``condition()``'s first truthy value; the page re-rendering under it (a
        missing or replaced element) counts as not yet."""

        def check(_: Any) -> Any:
            try:
                return condition()
            except (NoSuchElementException, StaleElementReferenceException):
                return False

        try:
            return WebDriverWait(self.browser, timeout).until(check)
        except TimeoutException:
            raise AssertionError(f"timed out waiting for {what}: {self._seen()}") from None

    def _seen(self) -> str:
        """What the page showed, for the failure message."""
        shown = [e.text for e in self.browser.find_elements(By.CSS_SELECTOR, "main, form")]
        logs = self.browser.get_log("browser")
        return f"page {' | '.join(t for t in shown if t)!r:.3000}; console log {logs!r:.2000}"

    def css(self, selector: str) -> Any:
        return self.browser.find_element(By.CSS_SELECTOR, selector)

    def texts(self, selector: str) -> list[str]:
        return [e.text for e in self.browser.find_elements(By.CSS_SELECTOR, selector)]

    def thread(self, thread: str) -> dict[str, Any]:
        response = self.http.get(f"/threads/{thread}")
        assert response.status_code == 200, response.text
        return dict(response.json())

    def labels(self, thread: str) -> list[str]:
        commits = self.http.get(f"/threads/{thread}/commits", params={"limit": 500}).json()
        return [c["commit"]["label"] for c in commits["commits"]]


def _browser_or_skip() -> webdriver.Chrome:
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        message = f"no browser: {', '.join(missing)} (apt-get install chromium chromium-driver)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--window-size=1200,940", "--no-first-run"):  # fmt: skip
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=ChromeService(CHROMEDRIVER))


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    """One server (tokens on), one browser signed in once (the token stays in the tab's
    sessionStorage), for the whole module."""
    browser = _browser_or_skip()
    store_url = f"sqlite:///{tmp_path_factory.mktemp('console')}/store.db"
    port = free_port()
    servers = ServerThread(store_url, [(port, ServeOptions(tokens=(TOKEN,)), ())])
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        servers.start()
    except BaseException:
        browser.quit()
        raise
    try:
        with httpx2.Client(base_url=url, headers=headers, timeout=60) as http:
            page = Console(url, browser, http)
            _sign_in(page)
            yield page
    finally:
        browser.quit()  # first: the stream its page holds open would hold up the shutdown
        servers.stop()
        asyncio.run(_shutdown(store_url))


async def _shutdown(store_url: str) -> None:
    client = await Ratchet.connect(store_url=store_url, quiet=True)
    await client.shutdown()


def _sign_in(page: Console) -> None:
    page.open("/")
    page.until(lambda: page.css("#login").is_displayed(), "the token prompt")
    page.css("#token").send_keys(TOKEN)
    page.css("#login button[type=submit]").click()
    page.until(lambda: page.css("#runs-view").is_displayed(), "the list of Runs")


def start(page: Console, agent: str, text: str = "go", wait: float = 30) -> str:
    thread = f"t-{uuid.uuid4().hex[:12]}"
    body = {"agent": agent, "input": text}
    response = page.http.post(f"/threads/{thread}/runs", params={"wait": wait}, json=body)
    assert response.status_code == 201, response.text
    return thread


def csp_violations(browser: webdriver.Chrome) -> list[str]:
    logs = browser.get_log("browser")
    return [e["message"] for e in logs if "Content Security Policy" in e["message"]]


def test_the_shell_needs_no_token_and_holds_no_data(console):
    thread = start(console, QUICK)
    for path in ("/", f"/console/threads/{thread}", "/console/static/console.js"):
        response = httpx2.get(console.url + path)  # no token
        assert response.status_code == 200, (path, response.text)
        assert response.headers["content-security-policy"] == CSP
        assert "script-src 'self'" in CSP and "unsafe-inline" not in CSP
        assert response.headers["x-content-type-options"] == "nosniff"
        assert thread not in response.text
    assert httpx2.get(f"{console.url}/console/threads/x").text == httpx2.get(console.url).text
    for segment in ("%FF", "%C0%AF", "%ED%A0%80"):  # not UTF-8: the API refuses it too
        refused = httpx2.get(f"{console.url}/console/threads/{segment}")
        assert refused.status_code == 422 and refused.json()["limit"] == "utf8"
    for method, path in [("GET", "/runs"), ("GET", f"/threads/{thread}"), ("POST", "/"),
                         ("GET", "/console"), ("GET", f"/threads/{thread}/stream")]:  # fmt: skip
        assert httpx2.request(method, console.url + path).status_code == 401, (method, path)
    missing = httpx2.get(f"{console.url}/console/static/../../runs")
    assert missing.status_code in (401, 404)
    assert httpx2.get(f"{console.url}/console/static/nothing.js").status_code == 404


def test_approve_an_awaiting_run_in_the_browser(console, tmp_path):
    console.open("/")
    console.until(lambda: console.css("#runs-view").is_displayed(), "the list of Runs")
    thread = start(console, PERMISSION, "Drop the users table on staging, please.")
    frontier = console.thread(thread)
    row = f"#runs tr[data-thread='{thread}']"
    console.until(  # the list polls: the Run appears without a reload
        lambda: console.css(row).get_attribute("data-state") == "awaiting", "the Run listed"
    )
    console.until(lambda: console.css(f"{row} td.agent").text == PERMISSION, "its agent")
    assert console.css(f"{row} td.run").text == frontier["run_id"]
    assert console.css(f"{row} td.state").text == "awaiting"
    assert console.css(f"{row} td.status").text == "idle · awaiting_permission"
    assert console.css(f"{row} td.steps").text == str(frontier["steps"])
    since = datetime.fromtimestamp(frontier["status"]["since"] / 1e6, UTC)
    assert console.css(f"{row} td.since").text == since.strftime("%Y-%m-%dT%H:%M:%SZ")
    console.browser.save_screenshot(str(tmp_path / "runs.png"))

    console.css(f"{row} td.thread a").click()
    console.until(lambda: console.css("#ticket-approve").is_displayed(), "the ticket")
    console.until(lambda: console.css("#commits tbody tr:last-child").text, "the commits")
    assert console.css("#thread-id").text == thread
    assert console.css("#run-state").get_attribute("data-state") == "awaiting"
    assert console.css(".ticket-call").text == 'drop_table({"name": "users"})'
    assert console.texts("#transcript .text") == [
        "Drop the users table on staging, please.",
        "may I?",
    ]
    assert console.css("#batch tr[data-call=c1]").get_attribute("data-phase") == "awaiting"
    assert console.texts("#commits td.label") == console.labels(thread)
    _screenshot(console.browser, tmp_path / "awaiting.png")

    console.css("#ticket-approve").click()
    state = console.css("#run-state")
    console.until(lambda: state.get_attribute("data-cause") == "natural", "the Run to end")
    assert state.get_attribute("data-state") == "ended"
    assert state.text == "ended (natural)"
    console.until(lambda: console.css("#ticket").is_displayed() is False, "the ticket gone")
    assert not console.css("#controls").is_displayed()
    assert console.css("#batch tr[data-call=c1]").get_attribute("data-phase") == "completed"
    assert console.css("#batch tr[data-call=c1] td.phase").text == "completed"
    assert console.texts("#transcript .text")[2:] == ["dropped users", "as you wished"]
    console.until(
        lambda: console.texts("#commits td.label") == console.labels(thread), "every commit"
    )
    assert console.texts("#commits td.label")[-3:] == ["resume", "results", "ended"]
    console.browser.save_screenshot(str(tmp_path / "ended.png"))
    assert csp_violations(console.browser) == []


def _screenshot(browser: webdriver.Chrome, path: Path) -> None:
    assert browser.save_screenshot(str(path))
    wanted = os.environ.get(SCREENSHOT_ENV)
    if wanted:
        shutil.copyfile(path, wanted)


def test_an_address_that_is_no_percent_encoding_names_no_thread(console):
    """``decodeURIComponent`` refuses ``%ZZ``: the page took the raw text for the thread
    id, so a thread named so stood (page, buttons and all) behind such an address."""
    console.open("/console/threads/%ZZ")
    error = console.css("#error")
    console.until(lambda: error.is_displayed(), "the error")
    assert error.text == "This address names no thread: it is not percent-encoded UTF-8."
    assert not console.css("#controls").is_displayed()


def test_the_list_says_why_it_has_no_runs_to_show(console):
    """A list the service refuses (a state filter no Run has) was a blank page."""
    console.open("/?state=bogus")
    error = console.css("#runs-error")
    console.until(lambda: error.is_displayed(), "the list's error")
    assert error.text.startswith("ValidationError: "), error.text
    assert console.css("#runs-view").is_displayed()
    console.open("/")
    console.until(lambda: console.css("#runs-view").is_displayed(), "the list of Runs")
    assert not console.css("#runs-error").is_displayed()


def test_html_is_shown_as_text_and_stop_ends_the_run(console):
    payload = (
        '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
        "<b>bold</b> &amp; </li></ol><h1>out</h1>"
    )
    thread = start(console, PERMISSION, payload)
    console.open(f"/console/threads/{thread}")
    first = "#transcript li:first-child .text"
    console.until(lambda: console.css(first).get_attribute("textContent") == payload, "the input")
    console.until(lambda: console.css("#controls").is_displayed(), "the controls")
    reason = "<i>over</i> budget"
    console.css("#stop-reason").send_keys(reason)
    console.css("#stop").click()
    state = console.css("#run-state")
    console.until(lambda: state.get_attribute("data-cause") == "stopped", "the Run stopped")
    assert state.text == f"ended (stopped: {reason})"
    for where in ("#transcript", "#run-state", "#commits"):
        for tag in ("script", "img", "b", "h1", "i"):
            assert console.browser.find_elements(By.CSS_SELECTOR, f"{where} {tag}") == []
    assert console.browser.execute_script("return window.pwned") is None
    assert console.thread(thread)["run_state"]["cause"] == {"kind": "stopped", "reason": reason}


@pytest.mark.timeout(120)
def test_the_page_follows_a_run_through_the_loss_of_its_host(console):
    thread = start(console, LONG_NAP, wait=0)
    console.open(f"/console/threads/{thread}")
    call = "#batch tr[data-call=c1]"
    phase = f"{call} td.phase"
    console.until(lambda: console.css(phase).text == "executing(1)", "the nap executing")
    ray.kill(_host_of(console, thread), no_restart=False)
    state = console.css("#run-state")
    console.until(
        lambda: state.get_attribute("data-cause") == "natural", "the recovered end", timeout=60
    )
    assert console.css(phase).text == "completed"
    assert int(console.css(f"{call} td.num").text) >= 2  # the lost attempt, then a replay
    statuses = console.texts("#commits td.status")
    lost = statuses.index("failed · execution_lost")
    assert "running" in statuses[lost + 1 :]
    assert console.texts("#transcript .text")[-1] == "rested"
    assert console.http.get("/runs").status_code == 200  # the service stayed up


def _host_of(console: Console, thread: str) -> Any:
    """The RunHost actor that owns the thread now (its owner id is ``HOST#PID``)."""
    runs = console.http.get("/runs", params={"limit": 1000}).json()["runs"]
    owner = next(r["owner"] for r in runs if r["thread_id"] == thread)
    return ray.get_actor(owner.rpartition("#")[0], namespace="ratchet")

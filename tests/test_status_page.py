"""The status page in a real browser: Debian's headless chromium, driven through selenium and its chromium-driver,
loads GET / from a live Coordinator (keys on) in front of a PD pair and a union engine while requests flow, and
sees every instance's row, a chart with points and a request rate above zero; an instance paused through the
management port shows paused within 3 s; the page fetched nothing but its own port (Chrome's performance log: the
DevTools protocol's Network events), and shows no key. A screenshot is saved in the test's temporary directory."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import openai
import pytest

from harness.clients import openai_client
from harness.configs import api_keys, coordinator_config, instance
from harness.coordinator import Coordinator

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
PD_MODEL, UNION_MODEL = "page-pd", "page-union"
KEY, MGMT_KEY = "sk-page-client", "m-page-operator"
MGMT = {"X-Motor-Management-Key": MGMT_KEY}

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)),
        reason="needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)",
    ),
]


def browser(profile: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1440,1000",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


def requested_urls(driver) -> list[str]:
    """Every URL the page asked for since the last call (DevTools Network.requestWillBeSent events)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


class Traffic:
    """Streamed chat requests to both models, from a few threads, until stopped."""

    def __init__(self, coord: Coordinator):
        self.client, self.stop_event, self.done = openai_client(coord, key=KEY), threading.Event(), 0
        self.threads = [threading.Thread(target=self._run, args=(m,), daemon=True) for m in (PD_MODEL, UNION_MODEL) * 2]

    def _run(self, model: str) -> None:
        while not self.stop_event.is_set():
            try:
                stream = self.client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "What is on the page?"}],
                    max_tokens=24,
                    stream=True,
                )
                for _ in stream:
                    pass
            except openai.APIError:  # a paused model's 503
                time.sleep(0.2)
                continue
            self.done += 1

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=30)


# Per instance row its state; per model its request rate and, per chart, the points of each line.
SEEN = """
const rows = {};
for (const r of document.querySelectorAll("#instances tbody tr[data-key]")) rows[r.dataset.key] = r.dataset.state;
const models = {};
for (const m of document.querySelectorAll(".model[data-model]")) {
  models[m.dataset.model] = {
    rps: parseFloat(m.querySelector(".rps").textContent) || 0,
    points: [...m.querySelectorAll("svg.chart")].map(c => [...c.querySelectorAll("polyline")].map(p => +p.dataset.points)),
  };
}
return {rows, models};
"""


def wait_for(what: str, check, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {timeout_s} s: {what}")
        time.sleep(0.1)


def test_the_status_page_in_a_browser(sims, tmp_path):
    p, d = sims("prefill", model=PD_MODEL), sims("decode", model=PD_MODEL)
    u = sims("union", model=UNION_MODEL)
    cfg = coordinator_config(
        [instance(1, "prefill", PD_MODEL, p.address), instance(2, "decode", PD_MODEL, d.address)]
        + [instance(3, "union", UNION_MODEL, u.address)],
        inference_workers_config={"num_workers": 2},
        api_key_config=api_keys(KEY),
        mgmt_api_key_config={"enable_api_key": True, "valid_keys": [MGMT_KEY]},
    )
    with Coordinator(cfg) as coord, Traffic(coord) as traffic:
        page = httpx.get(coord.obs + "/")  # no key: the page shows nothing secret
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["content-security-policy"]
        driver = browser(str(tmp_path / "profile"))
        try:
            driver.get("about:blank")
            requested_urls(driver)  # the browser's own start (its new-tab page) is not the page's
            started = time.monotonic()
            driver.get(coord.obs + "/")

            def seen() -> dict:
                """What the page shows now, read in one script (the page redraws itself every second)."""
                return driver.execute_script(SEEN)

            def rows() -> dict[str, str]:
                return seen()["rows"]

            wait_for("a row per instance", lambda: set(rows()) == {"1/0", "2/0", "3/0"})
            assert set(rows().values()) == {"healthy"}
            for model in (PD_MODEL, UNION_MODEL):
                wait_for(f"{model}'s request rate above zero", lambda m=model: seen()["models"][m]["rps"] > 0)
                charts = wait_for(
                    f"{model}'s request-rate chart with points",
                    lambda m=model: (c := seen()["models"][m]["points"])[0][0] >= 2 and c,
                )
                assert charts[1][0] >= 1  # its TTFT p50 line has points too
            assert traffic.done > 0

            refreshed = httpx.post(
                coord.mgmt + "/instances/refresh", json={"event": "pause", "instances": [3]}, headers=MGMT, timeout=5
            )
            assert refreshed.status_code == 200, refreshed.text
            wait_for("instance 3 paused on the page", lambda: rows().get("3/0") == "paused", timeout_s=3.0)
            assert rows()["1/0"] == rows()["2/0"] == "healthy"
            time.sleep(1.5)  # traffic on, the charts drawn again with the latest points

            shot = tmp_path / "status-page.png"
            driver.save_screenshot(str(shot))
            assert shot.stat().st_size > 10_000
            source = driver.page_source
            urls = requested_urls(driver)
            elapsed = time.monotonic() - started
        finally:
            driver.quit()
        for secret in (KEY, MGMT_KEY):
            assert secret not in source and secret not in httpx.get(coord.obs + "/status.json").text
        own = coord.obs + "/"
        assert urls and all(url.startswith(own) for url in urls), [url for url in urls if not url.startswith(own)]
        polls = [url for url in urls if url == own + "status.json"]
        assert len(polls) >= elapsed / 2 - 1, (len(polls), elapsed)  # it updates itself at least every 2 s

"""The screenshot in docs/trackers.md: an MLflow UI page of real runs, taken headless.

    python tools/mlflow_screenshot.py http://127.0.0.1:5000 EXPERIMENT_ID OUT.png

Needs `pip install playwright` and a Chromium (Debian's: /usr/bin/chromium); not a test and
not a dependency of the launcher. The runs are `train` runs with `log.trackers: [mlflow]`
against that server (docs/trackers.md says which)."""

from __future__ import annotations

import sys

from playwright.sync_api import sync_playwright

# Chromium on a machine with no outside network: no background connections, no sandbox (root).
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


def main(server: str, experiment: str, out: str) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 860})
        page.goto(f"{server}/#/experiments/{experiment}/runs")
        page.wait_for_timeout(5000)  # the UI polls: the network never goes idle
        page.get_by_text("Model training", exact=True).first.click()  # it opens on GenAI
        page.wait_for_timeout(2000)
        page.get_by_role("button", name="Close").first.click()  # the assistant's panel
        page.locator("label:has(input[value=CHART])").first.click()  # runs as charts
        page.wait_for_timeout(6000)  # the charts draw after their data arrives
        page.screenshot(path=out)
        browser.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])

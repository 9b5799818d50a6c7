"""A real browser: JupyterLab on localhost, the quickstart run top to bottom, the panel clicked.

Needs Debian's chromium (``.ci/run`` installs it with apt-get) and the ``playwright`` Python
package, which drives that browser through ``executable_path``: no browser download.
Screenshots land in test-artifacts/browser/.
"""

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-quic",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)"
    ),
]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def jupyter_lab(tmp_path):
    """JupyterLab on 127.0.0.1, a token, a free port, a private runtime dir; ended with all its kernels."""
    lab_root, runtime = tmp_path / "lab", tmp_path / "runtime"
    lab_root.mkdir()
    shutil.copy(ROOT / "notebooks" / "00_quickstart.ipynb", lab_root)
    token, port = secrets.token_hex(16), _free_port()
    settings = tmp_path / "lab-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    env = {
        **os.environ,
        "JUPYTER_RUNTIME_DIR": str(runtime),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "IPYTHONDIR": str(tmp_path / "ipython"),
        "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "lab-settings"),
    }
    log = open(tmp_path / "jupyterlab.log", "wb")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={lab_root}",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",  # no PyPI lookups from the test's server
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ],  # CI runs as root
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as reply:
                if reply.status == 200:
                    break
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"JupyterLab did not start:\n{(tmp_path / 'jupyterlab.log').read_text()[-3000:]}")
        time.sleep(0.5)
    try:
        yield url, token
    finally:
        try:
            request = urllib.request.Request(f"{url}/api/shutdown?token={token}", method="POST")
            urllib.request.urlopen(request, timeout=10)
            server.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(server.pid, sig)
                server.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        log.close()
        # No orphans: nothing started from this server's runtime dir (kernels) may survive it.
        time.sleep(1)
        survivors = [
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if str(runtime) in " ".join(p.info["cmdline"] or [])
        ]
        assert not survivors, f"processes outlived JupyterLab: {survivors}"


def _kernel_status(page) -> str | None:
    return page.locator(".jp-Notebook-ExecutionIndicator").first.get_attribute("data-status")


def _run_all_cells(page) -> None:
    """Run > Run All Cells, once the kernel is settled; again if it never started executing.

    On first load JupyterLab may start a kernel, replace it, and connect to the second one;
    cells queued during that switch are cancelled (their prompts stay empty).
    """
    for _attempt in range(2):
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
        time.sleep(3)  # let a kernel switch-over finish before anything is queued
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if _kernel_status(page) == "busy":
                return
            time.sleep(0.2)
    pytest.fail("the kernel never started executing the notebook's cells")


def test_quickstart_panel_runs_live_in_a_real_browser(jupyter_lab):
    url, token = jupyter_lab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{url}/lab/tree/00_quickstart.ipynb?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            _run_all_cells(page)

            run_button = page.locator("button.workbench-run")
            run_button.wait_for(timeout=400_000)  # the cells above it run a small ablation first
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
            more = page.get_by_text("More settings", exact=True).first
            more.scroll_into_view_if_needed()
            more.click()  # unfold the run settings that sit below the first row
            page.wait_for_timeout(300)
            page.screenshot(path=str(ARTIFACTS / "00-panel-settings.png"))
            run_button.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "01-panel.png"))
            run_button.click()

            live = page.locator("img.workbench-live-plot")
            status = page.locator(".workbench-status")
            frames, started = [], time.monotonic()
            while time.monotonic() - started < 300:
                text = status.inner_text()
                if live.is_visible() and live.get_attribute("src"):
                    live.scroll_into_view_if_needed()
                    frame = live.screenshot()
                    if not frames or frame != frames[-1]:
                        frames.append(frame)
                        (ARTIFACTS / f"02-live-{len(frames):02d}.png").write_bytes(frame)
                if text.startswith("Done") or "Error" in text or "Stopped" in text:
                    break
                time.sleep(1.0)
            table = page.locator(".workbench-results table")
            table.wait_for(timeout=60_000)
            table.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "03-results.png"), full_page=False)

            assert "Error" not in status.inner_text(), status.inner_text()
            assert status.inner_text().startswith("Done"), status.inner_text()
            assert len(frames) >= 3, (
                f"the live plot changed {len(frames) - 1} times during the run; expected 2 or more"
            )
            assert "baseline (control)" in table.inner_text()
            errors = page.locator(
                "[data-mime-type='application/vnd.jupyter.stderr'], .jp-OutputArea-output "
                "[data-mime-type='application/vnd.jupyter.error']"
            )
            assert errors.count() == 0, [errors.nth(i).inner_text()[:500] for i in range(errors.count())]
            # The second page: the advisor and the tuner, on the same job.
            tab = page.get_by_role("tab", name="Advise & tune")
            tab.scroll_into_view_if_needed()
            tab.click()
            tune_button = page.locator("button.workbench-tune")
            tune_button.wait_for(state="visible", timeout=10_000)
            page.wait_for_timeout(300)
            page.screenshot(path=str(ARTIFACTS / "04-advise-and-tune.png"))
            assert page.locator("button.workbench-advise").is_visible()
            (ARTIFACTS / "summary.json").write_text(json.dumps({"live_frames": len(frames)}))
        finally:
            page.screenshot(path=str(ARTIFACTS / "99-final.png"), full_page=True)
            browser.close()

"""A real browser: JupyterLab on localhost, the quickstart's panel opened and clicked.

The notebook it opens holds the quickstart's own cells that make the panel (the import and the
``wb.panel(...)`` cell, with the prose above the panel), not the ablations before them: those
run under nbval already, and running them again here cost minutes of CI for nothing the
browser sees.

Needs Debian's chromium (``.ci/run`` installs it with apt-get) and the ``playwright`` Python
package, which drives that browser through ``executable_path``: no browser download.
The panel is measured in the page at a notebook width of 1000 px: nothing past its right edge,
no control too narrow for its value, no empty band taller than 60 px; after the run, the results
table inside its output area, without scientific notation. Screenshots land in
test-artifacts/browser/: the panel as opened and with every setting shown, the live view's
frames, the results, the Advise & tune page.
"""

import json
import os
import re
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


PANEL_NOTEBOOK = "quickstart_panel.ipynb"


def _quickstart_panel_notebook() -> dict:
    """The quickstart, cut to the cells the panel needs: its first code cell (the import), and the
    markdown and code cells that introduce and make the panel. Read from the notebook itself, so
    the browser sees exactly the cells a reader runs."""
    notebook = json.loads((ROOT / "notebooks" / "00_quickstart.ipynb").read_text())
    cells = notebook["cells"]
    source = ["".join(cell["source"]) for cell in cells]
    code = [i for i, cell in enumerate(cells) if cell["cell_type"] == "code"]
    panel = next(i for i in code if "wb.panel(" in source[i])
    assert "import workbench as wb" in source[code[0]], "the quickstart's first code cell imports workbench"
    assert cells[panel - 1]["cell_type"] == "markdown", "the quickstart introduces its panel in prose"
    for cell in cells:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    notebook["cells"] = [cells[code[0]], cells[panel - 1], cells[panel]]
    return notebook


@pytest.fixture
def jupyter_lab(tmp_path):
    """JupyterLab on 127.0.0.1, a token, a free port, a private runtime dir; ended with all its kernels."""
    lab_root, runtime = tmp_path / "lab", tmp_path / "runtime"
    lab_root.mkdir()
    (lab_root / PANEL_NOTEBOOK).write_text(json.dumps(_quickstart_panel_notebook()))
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


# Measures the panel as drawn (run in the page on its root element): the visible elements that
# reach past its right edge; the controls too narrow for what they show (cut text without a
# tooltip, an option or a value wider than its box); and the tallest vertical gaps between
# the visible content (text, controls, images; clipped by the boxes that hide their overflow).
MEASURE_PANEL = """
(panel) => {
  const box = panel.getBoundingClientRect();
  const shown = (el) => el.checkVisibility({ checkOpacity: true, checkVisibilityCSS: true });
  const describe = (el) => {
    const classes = [...el.classList].filter((c) => c.startsWith("workbench") || c.startsWith("widget")).slice(0, 2);
    const text = (el.innerText || el.value || el.getAttribute("placeholder") || "").trim().slice(0, 40);
    return `${el.tagName.toLowerCase()}${classes.map((c) => "." + c).join("")} '${text}'`;
  };
  // What of a box its ancestors let show: each one that clips its overflow cuts it down.
  const clipped = (el, rect) => {
    let [left, top, right, bottom] = [rect.left, rect.top, rect.right, rect.bottom];
    for (let a = el.parentElement; a && a !== panel.parentElement; a = a.parentElement) {
      const style = getComputedStyle(a);
      if (style.overflowX === "visible" && style.overflowY === "visible") continue;
      const r = a.getBoundingClientRect();
      left = Math.max(left, r.left); right = Math.min(right, r.right);
      top = Math.max(top, r.top); bottom = Math.min(bottom, r.bottom);
    }
    return { left, top, right, bottom };
  };
  const pastEdge = [], content = [], cramped = [];
  const canvas = document.createElement("canvas").getContext("2d");
  const textWidth = (el, text) => { canvas.font = getComputedStyle(el).font; return canvas.measureText(text).width; };
  for (const el of panel.querySelectorAll("*")) {
    if (!shown(el)) continue;
    const rect = el.getBoundingClientRect();
    if (rect.width < 1 || rect.height < 1) continue;
    if (rect.right > box.right + 1) pastEdge.push(`${describe(el)} by ${Math.round(rect.right - box.right)} px`);
    const style = getComputedStyle(el);
    // Content: a control, an image, or an element with text of its own (measured as the text's box).
    let parts = [];
    if (["INPUT", "SELECT", "BUTTON", "IMG", "TEXTAREA", "CANVAS", "svg"].includes(el.tagName)) parts.push(rect);
    for (const node of el.childNodes) {
      if (node.nodeType !== Node.TEXT_NODE || !node.textContent.trim()) continue;
      const range = document.createRange();
      range.selectNodeContents(node);
      parts.push(range.getBoundingClientRect());
    }
    for (const part of parts) {
      const seen = clipped(el, part);
      if (seen.right - seen.left >= 2 && seen.bottom - seen.top >= 2) content.push({ top: seen.top, bottom: seen.bottom, what: describe(el) });
    }
    // Too narrow for what it holds: cut text with no tooltip to read it in, a value or an option
    // wider than its box.
    const cut = el.scrollWidth > el.clientWidth + 1 && style.overflowX !== "visible" && el.tagName !== "SELECT";
    if (cut && !el.closest("[title]") && el.clientWidth > 0 && [...el.childNodes].some((n) => n.nodeType === Node.TEXT_NODE && n.textContent.trim()))
      cramped.push(`${describe(el)}: text ${el.scrollWidth} px in ${el.clientWidth} px`);
    const inner = el.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    if (el.tagName === "SELECT") {
      const widest = Math.max(...[...el.options].map((o) => textWidth(el, o.text)));
      if (widest + 16 > inner) cramped.push(`${describe(el)}: option ${Math.round(widest)} px in ${Math.round(inner)} px`);
    }
    if (el.tagName === "INPUT" && ["text", "number"].includes(el.type)) {
      const shownText = el.value || el.placeholder || "";
      const room = inner - (el.type === "number" ? 16 : 0);  // a number box's spinner
      if (textWidth(el, shownText) > room) cramped.push(`${describe(el)}: '${shownText}' ${Math.round(textWidth(el, shownText))} px in ${Math.round(room)} px`);
    }
  }
  // Empty bands: the vertical gaps between the content boxes, and at the panel's top and bottom.
  content.sort((a, b) => a.top - b.top);
  const gaps = [];
  let reached = box.top, above = "the panel's top";
  for (const part of content) {
    if (part.top - reached > 0) gaps.push({ height: part.top - reached, above, below: part.what });
    if (part.bottom > reached) { reached = part.bottom; above = part.what; }
  }
  gaps.push({ height: box.bottom - reached, above, below: "the panel's bottom" });
  gaps.sort((a, b) => b.height - a.height);
  return { width: box.width, right: box.right, pastEdge, cramped, gaps: gaps.slice(0, 3) };
}
"""
NOTEBOOK_WIDTH = 1000  # px: the notebook area the issue measured the panel in
EMPTY_BAND_PX = 60
SCIENTIFIC = re.compile(r"\d(\.\d+)?[eE][+-]?\d")


def _set_notebook_width(page, width: int) -> None:
    """Resize the window until the notebook area (beside JupyterLab's side bar) is ``width`` px."""
    panel = page.locator(".jp-NotebookPanel").first
    now = panel.evaluate("element => element.getBoundingClientRect().width")
    viewport = page.viewport_size
    page.set_viewport_size({"width": round(viewport["width"] + width - now), "height": viewport["height"]})
    page.wait_for_timeout(500)
    assert abs(panel.evaluate("element => element.getBoundingClientRect().width") - width) < 2


def _check_the_panel_fits(page, moment: str) -> dict:
    """Every control inside the panel's right edge, wide enough for its value, no empty band."""
    measured = page.locator(".workbench-panel").evaluate(MEASURE_PANEL)
    assert not measured["pastEdge"], f"{moment}: past the panel's right edge: {measured['pastEdge']}"
    assert not measured["cramped"], f"{moment}: too narrow for what they show: {measured['cramped']}"
    tallest = measured["gaps"][0]
    assert tallest["height"] <= EMPTY_BAND_PX, (
        f"{moment}: an empty band of {tallest['height']:.0f} px between {tallest['above']} and {tallest['below']}"
    )
    return measured


def _show_every_setting(page) -> list:
    """JPEG data (dali can run), two ranks (ddp_compression can), every technique that can run
    switched on: each shows its settings. Returns the toggles it switched on."""
    _choose(page, "data", "jpeg")
    _type_into(page, "world_size", "2")
    for name in ("dali", "ddp_compression"):  # the kernel re-checks availability after each change
        page.wait_for_selector(f".workbench-technique-{name} input:not([disabled])", timeout=60_000)
    switched = []
    for toggle in page.locator(".workbench-panel [class*='workbench-technique-'] input[type=checkbox]").all():
        if toggle.is_enabled() and not toggle.is_checked():
            toggle.check()
            switched.append(toggle)
    page.wait_for_timeout(1000)
    return switched


def _choose(page, label: str, option: str) -> None:
    control = page.locator(".workbench-panel .widget-dropdown", has=page.locator(f"label:text-is('{label}')"))
    spaced = option.replace(" ", "\xa0")  # ipywidgets writes an option's spaces as no-break spaces
    control.first.locator("select").select_option(label=spaced)


def _type_into(page, label: str, value: str) -> None:
    control = page.locator(
        ".workbench-panel .widget-inline-hbox", has=page.locator(f"label:text-is('{label}')")
    )
    field = control.first.locator("input")
    field.fill(value)
    field.press("Enter")


def _watch_the_run(page) -> tuple[list[bytes], list[str]]:
    """The live plot's frames (saved as they change) and the status lines seen, until the run ends."""
    live = page.locator("img.workbench-live-plot")
    status = page.locator(".workbench-status")
    frames, lines, started = [], [], time.monotonic()
    while time.monotonic() - started < 300:
        text = status.inner_text()
        lines.append(text)
        if live.is_visible() and live.get_attribute("src"):
            live.scroll_into_view_if_needed()
            frame = live.screenshot()
            if not frames or frame != frames[-1]:
                frames.append(frame)
                (ARTIFACTS / f"02-live-{len(frames):02d}.png").write_bytes(frame)
        if text.startswith("Done") or "Error" in text or "Stopped" in text:
            break
        time.sleep(1.0)
    return frames, lines


def _check_the_results_table(page) -> None:
    """After a run: the table's right edge inside its output area, and no scientific notation."""
    tables = page.locator(".workbench-results table")
    tables.first.wait_for(timeout=60_000)
    shown = [table for table in tables.all() if table.is_visible()]
    assert shown, "no results table is visible"
    for table in shown:
        right, area = table.evaluate(
            "t => [t.getBoundingClientRect().right, t.closest('.jp-OutputArea-output').getBoundingClientRect().right]"
        )
        assert right <= area + 1, f"the results table ends {right - area:.0f} px past its output area"
        text = table.inner_text()
        assert not SCIENTIFIC.search(text), (
            f"scientific notation in the results: {SCIENTIFIC.search(text)[0]}"
        )
    assert "baseline (control)" in page.locator(".workbench-results").inner_text()


def _open_the_quickstart(page, url: str, token: str) -> None:
    """The notebook at the issue's width, every cell run, the panel's run settings unfolded."""
    page.goto(f"{url}/lab/tree/{PANEL_NOTEBOOK}?token={token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
    _set_notebook_width(page, NOTEBOOK_WIDTH)
    _run_all_cells(page)
    page.locator("button.workbench-run").wait_for(timeout=120_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
    more = page.get_by_text("More settings", exact=True).first
    more.scroll_into_view_if_needed()
    more.click()  # unfold the run settings that sit below the first row
    page.wait_for_timeout(300)


def _check_the_panel_before_the_run(page) -> None:
    """As the notebook opens it, then with every technique's settings shown; back to its job after."""
    panel = page.locator(".workbench-panel")
    data = page.locator(".workbench-panel select").nth(1).evaluate("s => s.options[s.selectedIndex].text")
    assert data.replace("\xa0", " ") == "digits (mlp's own)", f"the data control shows {data!r}"
    _check_the_panel_fits(page, "the panel as the notebook opens it")
    panel.screenshot(path=str(ARTIFACTS / "01-panel.png"))
    switched = _show_every_setting(page)
    _check_the_panel_fits(page, "every technique's settings shown")
    panel.screenshot(path=str(ARTIFACTS / "01-panel-every-setting.png"))
    for toggle in switched:  # back to the notebook's job: amp and grad_accum on mlp
        toggle.uncheck()
    _type_into(page, "world_size", "1")
    # The notebook's 200 steps take a minute here (bf16 autocast is emulated on this CPU); 60 still
    # give the live plot several frames and the status line its time left, as in test_widgets.
    _type_into(page, "steps", "60")
    _choose(page, "data", "digits (mlp's own)")
    page.wait_for_selector(".workbench-technique-ddp_compression input[disabled]", timeout=60_000)
    page.wait_for_timeout(500)


def _run_it(page) -> list[bytes]:
    """Press Run: the live view changes as it goes, the status line says how far it is and how long
    it has left, and the run ends done. Returns the live view's frames."""
    run_button = page.locator("button.workbench-run")
    run_button.scroll_into_view_if_needed()
    run_button.click()
    frames, lines = _watch_the_run(page)
    status = page.locator(".workbench-status").inner_text()
    assert "Error" not in status, status
    assert status.startswith("Done"), status
    assert len(frames) >= 3, (
        f"the live plot changed {len(frames) - 1} times during the run; expected 2 or more"
    )
    progress = re.compile(
        r"process \d+ of 3 · block \d of 3 · now: .+ · \d+:\d\d elapsed · about \d+:\d\d left"
    )
    assert any(progress.search(line) for line in lines), f"no status line with the time left: {lines[-5:]}"
    return frames


def _check_the_advise_page(page) -> None:
    """The second page: the advisor and the tuner, on the same job."""
    tab = page.get_by_role("tab", name="Advise & tune")
    tab.scroll_into_view_if_needed()
    tab.click()
    page.locator("button.workbench-tune").wait_for(state="visible", timeout=10_000)
    page.wait_for_timeout(300)
    page.screenshot(path=str(ARTIFACTS / "04-advise-and-tune.png"))
    assert page.locator("button.workbench-advise").is_visible()
    _check_the_panel_fits(page, "the Advise & tune page")


def test_quickstart_panel_runs_live_in_a_real_browser(jupyter_lab):
    url, token = jupyter_lab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for old in ARTIFACTS.glob("*.png"):  # a shorter run must not leave an earlier run's frames
        old.unlink()
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 2000})
        try:
            _open_the_quickstart(page, url, token)
            _check_the_panel_before_the_run(page)
            frames = _run_it(page)
            _check_the_results_table(page)
            page.locator(".workbench-results").scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "03-results.png"))
            page.locator(".workbench-panel").screenshot(path=str(ARTIFACTS / "03-panel-after-the-run.png"))
            _check_the_panel_fits(page, "after the run")
            errors = page.locator(
                "[data-mime-type='application/vnd.jupyter.stderr'], .jp-OutputArea-output "
                "[data-mime-type='application/vnd.jupyter.error']"
            )
            assert errors.count() == 0, [errors.nth(i).inner_text()[:500] for i in range(errors.count())]
            _check_the_advise_page(page)
            (ARTIFACTS / "summary.json").write_text(json.dumps({"live_frames": len(frames)}))
        finally:
            page.screenshot(path=str(ARTIFACTS / "99-final.png"), full_page=True)
            browser.close()


def test_the_report_fits_a_narrow_window_and_its_full_table_reads(tmp_path):
    """In an 800 px window the report's results table spilled past the page (the loss column cut
    off, its ! marks lost); opened, the full table squeezed an arm's note into its last column,
    which made that row some 500 px tall, and its right-aligned headings sat off their columns."""
    from helpers import result_row, synthetic_results

    note = "samples/s, which counts every timed step, came out lower than its speedup says; " * 6
    figures = dict(samples_per_s=77.7, step_ms=412.0, activation_mb=33.6, loss_vs_baseline=1.18)
    rows = [
        result_row("baseline", speedup=1.0, low=1.0, high=1.0, **figures),
        result_row("baseline (control)", speedup=1.06, low=0.94, high=1.19, **figures),
        result_row("grad_accum[steps=4]", speedup=0.67, low=0.30, high=1.49, **{**figures, "notes": note}),
    ]
    roles = {"baseline": "baseline", "baseline (control)": "control"}
    report = synthetic_results(rows, roles).to_html(tmp_path / "report.html")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 800, "height": 1000})
            page.goto(report.as_uri())
            assert page.evaluate("document.documentElement.scrollWidth") <= 800  # no sideways page
            page.click("details summary")
            page.screenshot(path=str(ARTIFACTS / "report-800px.png"), full_page=True)
            heights = page.evaluate(
                "[...document.querySelectorAll('details tbody tr')].map(r => r.getBoundingClientRect().height)"
            )
            assert max(heights) < 1.5 * min(heights), heights  # one line per arm, the note's too
            assert page.get_attribute("details td.wb-long", "title") == note  # whole on hover
            offsets = page.evaluate(
                """[...document.querySelectorAll('details thead th')].map((th, i) => Math.abs(
                    th.getBoundingClientRect().left
                    - document.querySelector(`details tbody tr td:nth-child(${i + 1})`).getBoundingClientRect().left))"""
            )
            assert max(offsets) < 2, offsets  # each heading starts where its column does
            # Printed (a browser's Print makes the PDF the README speaks of), the plot kept its
            # 1000 px least width inside a box that clips: its right quarter, memory panel and all,
            # was lost on A4. On paper it shrinks to the page instead.
            page.emulate_media(media="print")
            page.set_viewport_size({"width": 700, "height": 1000})
            widths = page.evaluate(
                "[...document.querySelectorAll('.wb-figure')].map(f => [f.scrollWidth, f.clientWidth])"
            )
            assert widths and all(scrolled <= shown for scrolled, shown in widths), widths
        finally:
            browser.close()

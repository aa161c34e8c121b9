"""The notebooks as a person meets them: JupyterLab in a real browser (Debian's chromium, driven by
selenium), from a copy of the repository, after `k3lab demo` and the README's `k3lab lab`.

For every notebook: open it, Run All, change one widget and see its output change, Save; no cell
errors, nothing on the page says FAILED, widgets are real widgets, pictures render, nothing runs off
a 1500 px wide page; afterwards `git status` in the copy is clean. Screenshots go to a temporary
folder whose path the test prints. Skipped, loudly, where there is no chromium and chromedriver
(`.ci/run` installs them as root).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser
from conftest import ROOT, wait_until  # noqa: E402  (the repository)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
SHOTS = Path(tempfile.mkdtemp(prefix="k3lab-screenshots-"))

# the pictures each notebook shows (02: the histograms, then one expert's codes and the heatmap)
PICTURES = {
    "01-tensor-layouts.ipynb": 0,
    "02-mxfp4-scales.ipynb": 3,
    "03-convert-a-file.ipynb": 1,
    "04-vision-and-tokenizer.ipynb": 1,
    "05-verify-a-run.ipynb": 1,
    "06-variants.ipynb": 6,
    "07-importance-matrix.ipynb": 3,
}
# one widget per notebook to change, and how to tell its output changed: (css of the <select> or
# <input>, the value to set, css of the element whose text must change)
WIDGET_CHANGES = {
    "01-tensor-layouts.ipynb": (".widget-dropdown select", "5", ".widget-html-content"),
    "02-mxfp4-scales.ipynb": (".widget-text input[type=number]", "3", ".jp-OutputArea-output img"),
    "04-vision-and-tokenizer.ipynb": (".widget-dropdown select", None, ".widget-html-content"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    if not (CHROMIUM and DRIVER):
        pytest.skip(
            "SKIPPED LOUDLY: no chromium/chromedriver here (apt-get install chromium chromium-driver)"
        )
    pytest.importorskip(
        "selenium", reason="SKIPPED LOUDLY: selenium is not installed (pip install '.[test]')"
    )
    repo = tmp_path_factory.mktemp("clone") / "k3lab"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(
        None, files.decode().split("\0")
    ):  # the working tree's tracked files, as a clone has them
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, repo / name)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "copy"], cwd=repo, check=True)
    env = {**os.environ, "K3LAB_HOME": str(repo), "JUPYTER_CONFIG_DIR": str(repo.parent / "jupyter-config")}
    k3lab = [sys.executable, "-m", "k3lab.cli"]
    subprocess.run([*k3lab, "demo"], cwd=repo, env=env, check=True, capture_output=True, timeout=600)
    port = _free_port()
    log = open(repo.parent / "lab.log", "w")
    proc = subprocess.Popen(
        [
            *k3lab,
            "lab",
            "--no-browser",
            f"--port={port}",
            "--ServerApp.token=",
            "--ServerApp.password=",
            "--ServerApp.disable_check_xsrf=True",
            "--expose-app-in-browser",
        ],
        cwd=repo,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    print(f"\nscreenshots: {SHOTS}")
    yield url, repo
    proc.terminate()
    proc.wait(timeout=30)
    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True).stdout
    assert status == "", f"saving changed tracked files:\n{status}"


@pytest.fixture(scope="module")
def browser(lab):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1500,1100",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-quic",
    ):
        opts.add_argument(arg)
    opts.add_argument(f"--user-data-dir={tempfile.mkdtemp(prefix='k3lab-chromium-')}")
    d = webdriver.Chrome(service=Service(DRIVER), options=opts)
    d.set_script_timeout(60)
    yield d
    d.quit()


def _wait(d, js: str, timeout: float = 240, what: str = "") -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            v = d.execute_script(js)
        except Exception:  # the app is still loading
            v = None
        if v:
            return v
        time.sleep(0.25)
    pytest.fail(f"timed out waiting for {what or js}")


PANEL = "const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"


def _here(d, css: str) -> list:
    """Elements matching ``css`` in the notebook on screen (other open notebooks are left out)."""
    return d.execute_script(PANEL + " return w ? [...w.node.querySelectorAll(arguments[0])] : [];", css)


KERNEL = (
    PANEL + " const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;"
)


# (01 and 05 by default; the others in `make test-slow`: each notebook runs headless by default too)
BY_DEFAULT = {"01-tensor-layouts.ipynb", "05-verify-a-run.ipynb"}


@pytest.mark.parametrize(
    "name",
    [
        n if n in BY_DEFAULT else pytest.param(n, marks=pytest.mark.slow)
        for n in sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    ],
)
def test_a_person_runs_and_saves_each_notebook(lab, browser, name: str) -> None:
    from selenium.webdriver.support.ui import Select

    url, repo = lab
    d = browser
    d.get(f"{url}/lab/tree/notebooks/{name}")
    _wait(
        d,
        KERNEL + " return k && k.status === 'idle' && w.context.path.endsWith(" + json.dumps(name) + ");",
        what="the notebook and an idle kernel",
    )
    d.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells');")
    _wait(
        d,
        KERNEL + " return k.status === 'idle' && w.content.widgets.filter(c => c.model.type === 'code')"
        ".every(c => c.model.executionCount !== null && c.model.sharedModel.execution_state !== 'running');",
        what="Run All to finish",
    )
    # widgets render: no "Loading widget" placeholder left (within a deadline, not a fixed pause)
    wait_until(
        lambda: "Loading widget" not in "\n".join(e.text for e in _here(d, ".jp-OutputArea-output")), 60, 0.2
    )
    errors = d.execute_script(
        PANEL + " return w.content.widgets.filter(c => c.model.type === 'code').flatMap(c => "
        "c.model.outputs.toJSON().filter(o => o.output_type === 'error').map(o => o.ename + ': ' + o.evalue));"
    )
    assert errors == [], errors
    text = "\n".join(e.text for e in _here(d, ".jp-OutputArea-output"))
    assert "FAILED" not in text and "K3LAB_RESULT" not in text and "Traceback" not in text
    assert "Loading widget" not in text and "Error displaying widget" not in text
    if name in WIDGET_CHANGES:
        assert _here(d, ".jupyter-widgets"), "no widget rendered"
    want = PICTURES[name]
    deadline = time.monotonic() + 60
    while len(_here(d, ".jp-OutputArea-output img")) < want and time.monotonic() < deadline:
        time.sleep(0.25)  # the widgets' plots arrive a moment after the cell's own
    images = _here(d, ".jp-OutputArea-output img")
    assert len(images) >= want, f"{name}: {len(images)} pictures, expected {want}"
    assert all(i.get_attribute("naturalWidth") not in (None, "0") for i in images)
    # nothing runs off a 1500 px page: outputs scroll inside themselves
    too_wide = d.execute_script(
        "return [...document.querySelectorAll('.jp-OutputArea-output')].filter(e => e.offsetParent !== null "
        "&& e.getBoundingClientRect().right > window.innerWidth + 1).length;"
    )
    assert too_wide == 0
    if name.startswith(
        "01"
    ):  # the shard's table readable at a glance: a line per row, 15 rows or more in view
        shown = d.execute_script(
            "const box = [...document.querySelectorAll('.jp-OutputArea-output div')].find(e => "
            "e.style.overflow === 'auto' && e.querySelector('table')); if (!box) return -1;"
            "box.scrollIntoView(); const b = box.getBoundingClientRect();"
            "return [...box.querySelectorAll('tbody tr')].filter(r => { const q = r.getBoundingClientRect();"
            " return q.top >= b.top && q.bottom <= b.bottom + 1; }).length;"
        )
        assert shown >= 15, f"01's table shows {shown} rows at once"
    for i, at in enumerate((0.0, 0.35, 0.7)):  # the top, the middle and further down, as a reader scrolls
        d.execute_script(
            PANEL
            + " const s = w.node.querySelector('.jp-WindowedPanel-outer'); if (s) s.scrollTop = arguments[0] * s.scrollHeight;",
            at,
        )
        time.sleep(0.5)
        d.save_screenshot(str(SHOTS / f"{name}-{i}.png"))
    if name in WIDGET_CHANGES:
        css, value, watched = WIDGET_CHANGES[name]
        before = [e.get_attribute("src") or e.text for e in _here(d, watched)]
        field = _here(d, css)[0]
        if field.tag_name == "select":
            sel = Select(field)
            if value is None:
                sel.select_by_index(1)
            else:
                sel.select_by_visible_text(value)
        else:
            field.clear()
            field.send_keys(value + "\n")
        from selenium.common.exceptions import StaleElementReferenceException

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                after = [e.get_attribute("src") or e.text for e in _here(d, watched)]
            except StaleElementReferenceException:  # (replaced while read: the redraw under way)
                after = before
            if after != before:
                break
            time.sleep(0.25)
        assert after != before, f"{name}: the widget's output did not change"
        d.save_screenshot(str(SHOTS / f"{name}-changed.png"))
    d.execute_script("window.jupyterapp.commands.execute('docmanager:save');")
    _wait(d, PANEL + " return !w.context.model.dirty;", what="the save")
    d.execute_script(PANEL + " w.close();")  # the next notebook opens alone
    assert not (repo / "notebooks" / "k3-demo").exists()  # no second checkpoint next to the notebooks

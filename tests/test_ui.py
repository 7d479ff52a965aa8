"""`tether ui` in a real headless browser (Debian's chromium through chromedriver), against a real
run in progress on the local backend and a completed 2-point sweep of the demo trainer; the token,
hostile ids and methods through urllib. Expected numbers are recomputed from the pulled files.
Screenshots of each page land in the test's tmp_path. Nothing sleeps: conditions are polled.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable

import pytest

from conftest import DEMO, REPO, Project, config_text
from helpers import Background, stop_leftover_runs

pytestmark = pytest.mark.xdist_group("ui")  # one browser, one server and one project per worker

# A trainer of its own that is slow enough to watch (a step every 50 ms) and writes hostile text
# into its log and into a metric's name: the page must show both as text.
SLOW_TRAINER = '''\
import sys, time
from tether.trainers import runtime
stop = runtime.stop_signal()
for step in range(1, 2001):
    runtime.log("step", step=step, total_steps=2000, loss=round(1.0 / step ** 0.5, 6))
    if step % 10 == 0:
        runtime.log("epoch", step=step, epoch=step // 10, accuracy=1 - 1.0 / step, **{"<i>acc</i>": step / 2000})
        print("step %d <script>document.title='pwned'</script>" % step, flush=True)
    if stop.requested:
        sys.exit(runtime.PREEMPTED_EXIT)
    time.sleep(0.05)
'''
SWEEP = "{python} demo/train.py --epochs 2 --lr 0.1 --seed {seed}"
URL = re.compile(r"tether ui: (http://[0-9.]+:\d+)/\?token=([A-Za-z0-9_-]+)")


@dataclass
class Site:
    """The project, its `tether ui` process, the browser, and the run in progress."""

    project: Project
    base: str
    token: str
    server: Background
    browser: Any
    slow: str

    def open(self, path: str = "/") -> None:
        self.browser.get(f"{self.base}{path}?token={self.token}")

    def js(self, script: str) -> Any:
        """`script`'s value in the page; polled callers retry while a meta refresh replaces the page."""
        return self.browser.execute_script(script)


def start_ui(project: Project, *args: str) -> tuple[Background, str, str]:
    """`tether ui ARGS` in the project, once it said its URL: (process, base URL, token)."""
    server = Background(subprocess.Popen([sys.executable, "-m", "tether.cli", "ui", *args], cwd=project.root,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                         start_new_session=True))
    project.wait_for(lambda: URL.search(server.text("stdout")) or server.proc.poll() is not None, 30, "the URL")
    found = URL.search(server.text("stdout"))
    assert found, server.output()
    return server, found.group(1), found.group(2)


def browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"  # with the driver's path given too, selenium-manager never runs
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound by the system's choice, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory, sshd):
    root = tmp_path_factory.mktemp("ui") / "proj"
    (root / "demo").mkdir(parents=True)
    for name in ("train.py", "points.csv"):
        shutil.copy(DEMO / name, root / "demo" / name)
    shutil.copy(REPO / "dodo.py", root / "dodo.py")
    (root / "demo" / "slow.py").write_text(SLOW_TRAINER)
    project = Project(root)
    lab = sshd.backend_config(root.parent / "far")
    sweep = lambda far: config_text(command=SWEEP) + f"  lab: {json.dumps(far)}\nsweep:\n  seed: [0, 1]\n"  # noqa: E731
    project.write_config(sweep(lab))
    (root / "slow.yaml").write_text(config_text(name="slow", command="{python} demo/slow.py", code="demo/slow.py",
                                                artifacts=""))
    project.doit("run", "train", check=True)
    project.doit("run", "launch", "config=slow.yaml", check=True)
    project.doit("run", "push", "backend=lab", check=True)  # records the sweep's runs on backend lab
    # ... which then cannot be reached: its rows show why, the rest of the page is unharmed
    project.write_config(sweep(dict(lab, port=closed_port())))
    slow = next(i for i in project.run_ids() if i.startswith("slow-"))
    server, base, token = start_ui(project)
    driver = browser()
    try:
        yield Site(project, base, token, server, driver, slow)
    finally:
        driver.quit()
        server.kill()
        stop_leftover_runs(root / ".tether" / "remote")
        stop_leftover_runs(root.parent / "far")


def settle(read: Callable[[], Any], holds: Callable[[Any], bool], timeout: float, what: str) -> Any:
    """Poll `read()` (a page being replaced by its meta refresh may fail a read) until `holds` its value."""
    from selenium.common.exceptions import WebDriverException

    deadline, value = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            value = read()
        except WebDriverException:
            value = None
        if value is not None and holds(value):
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last read: {value!r})")


def runs_on(site: Site, backend: str, name: str = "demo") -> list[str]:
    """The ids of the runs of job `name` recorded here for `backend`, read from their run.json."""
    found = []
    for run_id in site.project.run_ids():
        record = json.loads((site.project.local_run(run_id) / "run.json").read_text())
        if record["backend"] == backend and record["name"] == name:
            found.append(run_id)
    return found


def cell(site: Site, run_id: str, column: int) -> Any:
    return site.js(f"const r = document.querySelector('tr[data-run=\"{run_id}\"]');"
                   f"return r && r.children[{column}].textContent;")


def fetch(url: str, method: str = "GET", headers: dict | None = None) -> tuple[int, dict, str]:
    """(status, headers, body) of one request by urllib (an HTTP error is an answer too)."""
    request = urllib.request.Request(url, method=method, headers=headers or {}, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, dict(answer.headers), answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read().decode()


# ---------------------------------------------------------------- the pages, in the browser


def test_runs_page_shows_the_run_in_progress_and_its_step_advances(site, tmp_path):
    site.open()
    first = settle(lambda: cell(site, site.slow, 4), lambda t: re.match(r"\d+", t.strip()), 30, "the run's step")
    assert settle(lambda: cell(site, site.slow, 3), lambda t: t == "running", 10, "running") == "running"
    later = settle(lambda: cell(site, site.slow, 4),
                   lambda t: re.match(r"\d+", t.strip()) and int(re.match(r"\d+", t.strip()).group()) >
                   int(re.match(r"\d+", first.strip()).group()), 20, "the step to advance after a refresh")
    assert int(later.split("/")[0]) > int(first.split("/")[0])
    site.open(f"/run/{site.slow}")  # its events were read: the total is known
    site.open()
    bar = "const b = document.querySelector('tr[data-run=\"%s\"] progress'); return b && [b.value, b.max];"
    assert settle(lambda: site.js(bar % site.slow), lambda b: True, 20, "the step's bar")[1] == 2000
    assert len(runs_on(site, "local")) == 2
    for run_id in runs_on(site, "local"):
        assert cell(site, run_id, 10) == "yes"  # the sweep's points were pulled and verified by `train`
        assert cell(site, run_id, 3) == "completed"
    site.browser.save_screenshot(str(tmp_path / "ui-runs.png"))


def test_run_page_curve_gains_points_and_shows_the_log(site, tmp_path):
    site.open(f"/run/{site.slow}")
    count = "const p = document.querySelector('polyline[data-name=\"loss\"]'); return p && +p.dataset.points;"
    first = settle(lambda: site.js(count), lambda n: n > 0, 30, "a loss curve")
    settle(lambda: site.js(count), lambda n: n > first, 20, "the curve to gain points")
    log = settle(lambda: site.js("return document.getElementById('log').textContent;"),
                 lambda t: re.search(r"^step \d+0 ", t, re.M), 20, "the log's tail")
    assert re.search(r"^step \d+0 <script>document.title='pwned'</script>$", log, re.M), log
    site.browser.save_screenshot(str(tmp_path / "ui-run.png"))


def test_hostile_text_is_shown_as_text(site):
    site.open(f"/run/{site.slow}")
    settle(lambda: site.js("return document.getElementById('log').textContent;"), lambda t: "<script>" in t,
           20, "the log with its <script> line")
    assert site.js("return document.querySelectorAll('body script, #log *').length") == 0
    assert site.js("return document.title") == f"tether: {site.slow}"  # the log's script did not run
    names = site.js("return [...document.querySelectorAll('polyline')].map(p => p.dataset.name)")
    assert "<i>acc</i>" in names
    site.open()
    metrics = settle(lambda: cell(site, site.slow, 5), lambda t: "<i>acc</i>" in t, 20, "the hostile metric")
    assert "loss" in metrics and site.js("return document.querySelectorAll('#runs i').length") == 0


def test_completed_sweep_shows_its_table(site, tmp_path):
    site.open()
    rows = settle(lambda: site.js("return [...document.querySelectorAll('table.sweep tr')]"
                                  ".map(r => [...r.children].map(c => c.textContent))"), lambda r: len(r) == 2,
                  20, "the sweep's table")
    found = {}
    for run_id in runs_on(site, "local"):
        metrics = json.loads((site.project.local_run(run_id) / "files" / "artifacts" / "metrics.json").read_text())
        for name, value in metrics.items():
            found.setdefault(name, []).append(value)
    assert rows[0] == ["n"] + sorted(found)  # metric names in the order the points list them
    expected = [f"{statistics.fmean(v):.4g} ± {statistics.stdev(v):.4g}" for _, v in sorted(found.items())]
    assert rows[1] == ["2"] + expected
    site.browser.save_screenshot(str(tmp_path / "ui-sweep.png"))


def test_check_button_shows_the_preflight(site, tmp_path):
    from selenium.webdriver.common.by import By

    site.open()
    settle(lambda: site.browser.find_element(By.CSS_SELECTOR, "form[action='/check/local'] button"),
           lambda b: True, 10, "the Check button").click()
    report = settle(lambda: site.js("const r = document.getElementById('report'); return r && r.textContent;"),
                    lambda t: True, 30, "the preflight's report")
    assert report.startswith("backend local: ready\n"), report
    assert re.search(r"^ok  disk: \d+ MB free under ", report, re.M)
    site.browser.save_screenshot(str(tmp_path / "ui-check.png"))


def test_an_unreachable_backend_shows_its_error_in_its_rows(site):
    site.open()
    far = runs_on(site, "lab")
    assert len(far) == 2
    for run_id in far:
        text = settle(lambda: cell(site, run_id, 0), lambda t: True, 20, f"the row of {run_id}")
        assert "backend lab did not answer" in text, text
    assert cell(site, site.slow, 3) == "running"  # the other backend's rows are whole
    assert site.js("return document.querySelectorAll('table.sweep').length") == 1  # lab's points: none verified
    site.open(f"/run/{far[0]}")
    assert "did not answer" in site.js("return document.body.textContent")
    status, _, body = fetch(f"{site.base}/check/lab?token={site.token}", "POST")
    assert status == 200 and "backend lab: the preflight failed" in body, body


def test_one_round_trip_per_backend_per_refresh(site):
    """Page loads within the refresh interval ask no backend again; the next refresh asks each once."""
    from tether.pipelines.session import Session
    from tether.ui.catalog import Catalog

    now = [0.0]
    opened = Catalog.open(Session.open({"config": str(site.project.root / "tether.yaml")}, cwd=str(site.project.root)))
    catalog = Catalog(opened.sessions, opened.problems, opened.state_dir, refresh_s=2.0, clock=lambda: now[0])
    asked: list[tuple[str, int]] = []
    for name, s in catalog.sessions.items():
        real = s.backend.states
        s.backend.states = lambda runs, name=name, real=real: asked.append((name, len(runs))) or real(runs)
    first = catalog.rows()
    assert sorted(name for name, _ in asked) == ["lab", "local"]  # one question per backend, all its runs in it
    assert dict(asked)["local"] == 3 and dict(asked)["lab"] == 2
    now[0] = 1.9
    assert catalog.rows() is first and catalog.rows() is first and len(asked) == 2
    now[0] = 2.0
    catalog.rows()
    assert sorted(name for name, _ in asked[2:]) == ["lab", "local"]
    assert dict(asked[2:])["local"] == 1  # the sweep's ended runs are not asked again; the slow run is


# ---------------------------------------------------------------- refusals, by urllib


def test_every_request_needs_the_token(site):
    run = f"/run/{site.slow}"
    assert fetch(site.base + "/")[0] == 403
    assert fetch(site.base + run)[0] == 403
    wrong = site.token[:-1] + ("y" if site.token.endswith("x") else "x")  # wrong in its last character only
    assert fetch(site.base + "/?token=" + wrong)[0] == 403
    assert fetch(site.base + "/check/local", "POST")[0] == 403
    port = site.base.rsplit(":", 1)[1]
    assert fetch(site.base + "/", headers={"Cookie": f"tether_ui_{port}=wrong"})[0] == 403
    status, headers, body = fetch(f"{site.base}/?token={site.token}")
    assert status == 200 and site.slow in body
    assert headers["Set-Cookie"].startswith(f"tether_ui_{port}={site.token};") and "HttpOnly" in headers["Set-Cookie"]
    assert "script-src" not in headers["Content-Security-Policy"] and "default-src 'none'" in \
        headers["Content-Security-Policy"]  # no script may run at all
    assert fetch(site.base + run, headers={"Cookie": f"tether_ui_{port}={site.token}"})[0] == 200


@pytest.mark.parametrize("path", ["/run/../../etc/passwd", "/run/..%2F..%2Fetc%2Fpasswd", "/run/x;rm%20-rf%20~",
                                  "/run/x%3Brm%20-rf%20~", "/run/demo-20000101T000000Z-00000000", "/run/",
                                  "/etc/passwd", "/check/local"])
def test_hostile_or_unknown_paths_get_404(site, path):
    assert fetch(f"{site.base}{path}?token={site.token}")[0] == 404
    assert fetch(f"{site.base}/run/{site.slow}?token={site.token}")[0] == 200  # the same request, for a known run


def test_only_get_and_a_check_post(site):
    assert fetch(f"{site.base}/check/nope?token={site.token}", "POST")[0] == 404
    assert fetch(f"{site.base}/check/..%2Flocal?token={site.token}", "POST")[0] == 404
    assert fetch(f"{site.base}/?token={site.token}", "POST")[0] == 404
    for method in ("PUT", "DELETE"):
        assert fetch(f"{site.base}/run/{site.slow}?token={site.token}", method)[0] == 501


# ---------------------------------------------------------------- the command


def test_other_host_warns_and_ctrl_c_stops_cleanly(site):
    server, base, token = start_ui(site.project, "host=127.0.0.2")
    assert base.startswith("http://127.0.0.2:")
    assert "warning: listening on 127.0.0.2" in server.text("stderr") and "has the token sees the runs" in \
        server.text("stderr")
    assert fetch(f"{base}/?token={token}")[0] == 200
    server.proc.send_signal(signal.SIGINT)
    assert server.finish(timeout=30) == 0, server.output()
    assert "tether ui: stopped" in server.text("stdout")


def test_a_bad_port_is_one_line(site):
    done = site.project.tether("ui", "port=http")
    assert done.returncode != 0
    assert "port=http: give a port number from 1 to 65535, or 0 for any free one" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout

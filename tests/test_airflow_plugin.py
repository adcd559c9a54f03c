"""The Privacy budget inside the Airflow UI (issue 21 item 17), through a real api-server.

One module-scoped ``airflow api-server`` (FAB auth manager, as deploy/ uses) loads ``plugins/``; a
ledger and a manifests directory hold two published intervals and one refusal made by the real CLI
(``dpops release run --publish``, the Beam job replaced by the CLI tests' stand-in). A headless
Chromium logs in through FAB's login form and reads the page and a DAG run's tab: the figures equal
``dpops ledger status --json`` passed through ``format_budget``, the tab's verification equals
``dpops manifest verify``. Every plugin route refuses an anonymous request (plain HTTP) and the
manifest download serves nothing but a manifest of the directory. Every process is stopped by its PID.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from airflow_support import REPO, VENV_BIN, airflow_cli_batch, airflow_env, stop_process
from browser_support import Browser, Page, require_chromium
from cli_support import DAYS, make_env

from dpops.ledger.budget import format_budget

DPOPS_BIN = str(VENV_BIN / "dpops")
AIRFLOW = str(VENV_BIN / "airflow")
FAB = "airflow.providers.fab.auth_manager.fab_auth_manager.FabAuthManager"
SCREENSHOT = REPO / "docs" / "img" / "airflow-privacy-budget.png"

pytestmark = pytest.mark.slow  # one api-server for the module: about 90-120 s on a shared 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(method: str, url: str, body: dict | None = None, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The api-server and its data; HTTP-only tests need no browser (the ``browser`` fixture starts one)."""
    root = tmp_path_factory.mktemp("uiplugin")
    with pytest.MonkeyPatch.context() as mp:
        import dpops.release_plan

        env = make_env(root, mp, planner_fn=dpops.release_plan.plan_release)
        mdir = root / "manifests"
        mp.setenv("DPOPS_MANIFESTS_DIR", str(mdir))
        from dpops.cli.main import main

        codes = [main(["release", "run", str(env.spec), *env.base(d), "--ledger", env.url, "--no-progress",
                       "--publish"]) for d in DAYS[:3]]
    assert codes == [0, 0, 5], f"two publications and one refusal expected, got exit codes {codes}"
    # make_env's spec.yaml (the DAG dpops_purchases_test) and a second release on the same scope, never run:
    # the DAG dpops_other_test, the only one the user "onedag" may read (issue 25 item 11)
    import yaml

    other = yaml.safe_load(env.spec.read_text())
    other["name"] = "other_test"
    (root / "other.yaml").write_text(yaml.safe_dump(other))
    specs = root
    home = root / "airflow"
    home.mkdir()
    port = _free_port()
    password = secrets.token_urlsafe(16)
    aenv = airflow_env(home, f"sqlite:///{home / 'airflow.db'}", specs,
                       AIRFLOW__CORE__AUTH_MANAGER=FAB,
                       AIRFLOW__CORE__PLUGINS_FOLDER=str(REPO / "plugins"),
                       AIRFLOW__API_AUTH__JWT_SECRET=secrets.token_urlsafe(32),
                       AIRFLOW__API__SECRET_KEY=secrets.token_urlsafe(32),
                       AIRFLOW__API__BASE_URL=f"http://127.0.0.1:{port}",
                       DPOPS_LEDGER_URL=env.url, DPOPS_MANIFESTS_DIR=str(mdir),
                       PYTHONPATH=str(REPO))

    def airflow(*argv: str) -> None:
        p = subprocess.run([AIRFLOW, *argv], env=aenv, capture_output=True, text=True, timeout=240, cwd=root)
        assert p.returncode == 0, f"airflow {argv[0]} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"

    airflow("db", "migrate")
    log = open(root / "api-server.log", "wb")
    proc = subprocess.Popen([AIRFLOW, "api-server", "--port", str(port), "--host", "127.0.0.1"], env=aenv,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root)
    try:  # while the api-server boots: the DAG (for a run to show a tab on) and the FAB users, one interpreter
        airflow_cli_batch(aenv, [
            ["dags", "reserialize"],
            ["users", "create", "--username", "admin", "--password", password, "--role", "Admin",
             "--firstname", "Ad", "--lastname", "Min", "--email", "admin@example.invalid"],
            # A user allowed one DAG (FAB's per-DAG permission), as a team member of another release would be
            ["sync-perm", "--include-dags"],
            ["roles", "create", "OneDag"],
            ["roles", "add-perms", "OneDag", "-r", "DAG:dpops_other_test", "-a", "can_read"],
            ["users", "create", "--username", "onedag", "--password", password, "--role", "OneDag",
             "--firstname", "One", "--lastname", "Dag", "--email", "onedag@example.invalid"],
        ], cwd=root)
    except BaseException:
        stop_process(proc)
        log.close()
        raise
    api = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (root / "api-server.log").read_text()[-4000:]
            try:
                if _http("GET", f"{api}/api/v2/monitor/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "api-server did not become healthy"
            time.sleep(1)
        code, body = _http("POST", f"{api}/auth/token", {"username": "admin", "password": password})
        assert code in (200, 201), body
        token = admin_token = json.loads(body)["access_token"]
        code, body = _http("POST", f"{api}/auth/token", {"username": "onedag", "password": password})
        assert code in (200, 201), body
        yield {"api": api, "token": token, "admin_token": admin_token, "onedag_token": json.loads(body)["access_token"],
               "password": password, "env": env, "mdir": mdir, "root": root, "aenv": aenv}
    finally:
        stop_process(proc)
        log.close()


@pytest.fixture(scope="module")
def browser(stack):
    b = Browser(require_chromium(), stack["root"] / "chromium")
    yield b
    b.close()


def _cli(*argv: str, env: dict[str, str]) -> dict:
    p = subprocess.run([DPOPS_BIN, *argv], env=env, capture_output=True, text=True, timeout=120)
    assert p.stdout.strip(), p.stderr
    return json.loads(p.stdout)


def _login(stack, browser) -> Page:
    """Log in through FAB's own form, as an operator does; returns the page (cookie set)."""
    page = browser.open(f"{stack['api']}/auth/login/")
    page.evaluate(f"""(() => {{
        document.querySelector('input[name=username]').value = 'admin';
        document.querySelector('input[name=password]').value = {json.dumps(stack['password'])};
        const f = document.querySelector('form[name=login]'); (f.requestSubmit ? f.requestSubmit() : f.submit()); return 1; }})()""")
    page.wait_for("Page.loadEventFired", 60)
    page.pump(1.0)
    return page


def test_every_plugin_route_refuses_anonymous_requests(stack):
    api, run_id = stack["api"], next(stack["mdir"].glob("*.published.json")).name[:32]
    routes = ["/dpops-budget/", f"/dpops-budget/manifests/{run_id}", "/dpops-budget/runs/dpops_purchases_test/x"]
    for r in routes:
        code, body = _http("GET", api + r)
        assert code in (401, 403), f"{r}: anonymous request answered {code}: {body[:200]!r}"
        assert run_id.encode() not in body and b"shop" not in body
        code, _ = _http("GET", api + r, token="not-a-token")
        assert code in (401, 403), f"{r}: a forged token answered {code}"
    # The plugin is loaded by this api-server (not only importable).
    code, body = _http("GET", f"{api}/api/v2/plugins", token=stack["admin_token"])
    assert code == 200 and "dpops_budget" in {p["name"] for p in json.loads(body)["plugins"]}, body[:500]


def test_manifest_download_serves_only_manifests_of_the_directory(stack):
    api, tok, mdir = stack["api"], stack["token"], stack["mdir"]
    f = next(mdir.glob("*.published.json"))
    code, body = _http("GET", f"{api}/dpops-budget/manifests/{f.name[:32]}", token=tok)
    assert code == 200 and body == f.read_bytes()
    secret = stack["root"] / "noise.key"
    planted = mdir / ("f" * 32 + ".published.json")
    planted.symlink_to(secret)  # a symlink named like a manifest, pointing at the key
    try:
        for bad in ["f" * 32, "..%2F..%2Fnoise.key", "..%2Fnoise.key", "%2E%2E", "F" * 32, "a" * 31, "a" * 33,
                    f.name, f.name[:32] + "%00"]:
            code, body = _http("GET", f"{api}/dpops-budget/manifests/{bad}", token=tok)
            assert code in (404, 422), f"{bad}: answered {code}"
            assert b"dpops-noise-key" not in body
    finally:
        planted.unlink()


def test_a_user_allowed_one_dag_sees_only_that_dags_budget(stack):
    """Issue 25 item 11: "onedag" may read DAG dpops_other_test only. The page shows it no manifest of
    dpops_purchases_test and not the figures of scope shop (they compose purchases_test's charges); the
    download of a purchases_test manifest is "not found"; the tab of a purchases_test run is refused."""
    api, mdir = stack["api"], stack["mdir"]
    f = next(mdir.glob("*.published.json"))
    code, body = _http("GET", f"{api}/dpops-budget/", token=stack["onedag_token"])
    assert code == 200, body[:500]
    text = body.decode()
    assert 'data-scope="shop"' not in text and "scope shop: its figures are not shown" in text
    assert not any(p.name[:12] in text for p in mdir.glob("*.json"))
    code, body = _http("GET", f"{api}/dpops-budget/manifests/{f.name[:32]}", token=stack["onedag_token"])
    assert code == 404 and f.read_bytes() not in body, (code, body[:300])
    code, _ = _http("GET", f"{api}/dpops-budget/runs/dpops_purchases_test/x", token=stack["onedag_token"])
    assert code == 403
    # the admin, allowed every DAG, sees the scope and downloads the manifest
    code, body = _http("GET", f"{api}/dpops-budget/", token=stack["admin_token"])
    assert code == 200 and 'data-scope="shop"' in body.decode()
    assert _http("GET", f"{api}/dpops-budget/manifests/{f.name[:32]}", token=stack["admin_token"])[0] == 200


def test_a_rest_triggered_run_has_its_tab(stack):
    """Issue 28 item 2: a run triggered the documented way (REST ``logical_date: null``, ``conf.interval``) has no
    data interval; its tab resolves the interval as the DAG does and shows the ledger run of that day."""
    import re

    api, env = stack["api"], stack["env"]
    code, body = _http("POST", f"{api}/api/v2/dags/dpops_purchases_test/dagRuns",
                       {"dag_run_id": "rest_tab_check", "logical_date": None, "conf": {"interval": "2024-01-02"}},
                       token=stack["admin_token"])
    assert code in (200, 201), body[:500]
    code, body = _http("GET", f"{api}/dpops-budget/runs/dpops_purchases_test/rest_tab_check", token=stack["admin_token"])
    assert code == 200, body[:500]
    text = body.decode()
    cenv = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
    runs = _cli("ledger", "--ledger", env.url, "runs", "--json", env=cenv)["runs"]
    (mine,) = [r for r in runs if r["key"]["interval_start"].startswith("2024-01-02")]
    assert "not a dpops release run" not in text
    assert re.search(r'data-field="run">([0-9a-f]{32})<', text).group(1) == mine["run_id"], text[:2000]
    assert 'data-field="state">committed<' in text
    # not yet reserved by this DAG run (no scheduler here): the tab says the run shown may be another's
    assert "another DAG run may have made" in text


def test_browser_reads_the_budget_page_and_a_run_tab(stack, browser):
    env, api = stack["env"], stack["api"]
    cenv = {**os.environ, "DPOPS_MANIFESTS_DIR": str(stack["mdir"]), "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
    status = _cli("ledger", "--ledger", env.url, "status", "shop", "--json", env=cenv)
    page = _login(stack, browser)
    page.events = []  # Airflow's own UI after login is not under test: only the plugin page's console
    page.navigate(f"{api}/dpops-budget/")
    cells = page.evaluate("""Object.fromEntries([...document.querySelectorAll('#scopes tr[data-scope="shop"] td[data-field]')]
        .map(td => [td.dataset.field, td.textContent]))""")
    assert cells, page.evaluate("document.body.innerText")[:2000]
    cap = status["cap"]
    for f in ("committed", "spent_unpublished", "started", "reserved", "total", "remaining"):
        assert cells[f] == format_budget(status[f], cap), (f, cells, status)
    assert cells["cap"] == format_budget(cap)
    text = page.evaluate("document.body.innerText")
    assert page.evaluate("[...document.querySelectorAll('#open td')].map(t => t.textContent).join('|')").count("refused") >= 1
    assert page.evaluate("document.querySelectorAll('svg path').length") == 1
    downloads = page.evaluate("[...document.querySelectorAll('#manifests a')].map(a => a.getAttribute('href'))")
    assert sorted(h.rsplit("/", 1)[1] for h in downloads) == sorted(p.name[:32] for p in stack["mdir"].glob("*.json"))
    assert env.url not in text and str(env.key) not in text and "dpops-noise-key" not in text
    assert not page.console_errors()
    # The nav entry inside Airflow's own UI: the page in its iframe, as an operator sees it.
    page.send("Emulation.setDeviceMetricsOverride", width=1280, height=860, deviceScaleFactor=1, mobile=False)
    page.navigate(f"{api}/plugin/privacy-budget")
    deadline = time.monotonic() + 30
    while not page.evaluate("!!document.querySelector('iframe') && !!document.querySelector('iframe')"
                            ".contentDocument?.querySelector('#scopes')"):
        assert time.monotonic() < deadline, "the Airflow UI did not show the plugin page in its nav view"
        page.pump(0.5)
    page.pump(1.0)
    shot = page.send("Page.captureScreenshot", format="png")["data"]
    out = stack["root"] / "privacy-budget.png"
    out.write_bytes(base64.b64decode(shot))
    if os.environ.get("DPOPS_UPDATE_SCREENSHOT"):  # refresh docs/img (deploy/README.md shows it)
        from PIL import Image  # matplotlib's dependency ([report] extra): 64 colours keep the PNG small

        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        Image.open(out).convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(SCREENSHOT,
                                                                                               optimize=True)

    # A DAG run of the release for the second (published) day, created through the REST API.
    code, body = _http("POST", f"{api}/api/v2/dags/dpops_purchases_test/dagRuns", {
        "dag_run_id": "ui_tab_check", "logical_date": "2024-01-02T00:00:00Z",
        "data_interval_start": "2024-01-02T00:00:00Z", "data_interval_end": "2024-01-03T00:00:00Z"},
        token=stack["admin_token"])  # a Viewer may not trigger runs; the operator reads the tab below
    assert code in (200, 201), body[:500]
    page.navigate(f"{api}/dpops-budget/runs/dpops_purchases_test/ui_tab_check")
    run = page.evaluate("""Object.fromEntries([...document.querySelectorAll('#run td[data-field]')]
        .map(td => [td.dataset.field, td.textContent]))""")
    rec = _cli("ledger", "--ledger", env.url, "runs", "--json", env=cenv)
    mine = [r for r in rec["runs"] if r["key"]["interval_start"].startswith("2024-01-02")]
    assert run["run"] == mine[0]["run_id"] and run["ε of this run"] == format_budget(mine[0]["epsilon"], cap)
    assert run["scope total after it"] == format_budget(1.0, cap)
    assert run["mechanisms"] and run["state"] == "committed"
    verify = _cli("manifest", "verify", mine[0]["run_id"], "--ledger", env.url, "--json", env=cenv)
    shown = page.evaluate("document.getElementById('verification').textContent")
    assert (shown == "FAILED") == (not verify["ok"]), (shown, verify)
    assert shown == "verified (partly)"
    page.close()

"""Issue 21 item 16: the GX project's Data Docs render offline (dpops' own index, dpops.gx_docs).

A real checkpoint (the sandboxed one of dpops.gx_project) runs twice, once passing and once failing a
team suite; the index is then opened in headless Chromium with the network emulated OFF. It must list
both validations, styled, with working links to GX's pages and without a single non-file request. GX's
own index, opened the same way, asks its CDNs: the negative control that this test can fail.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pandas as pd
import pytest

from dpops.errors import IntegrityError
from dpops.gx_docs import ValidationRow, render
from dpops.gx_project import data_docs_index, run_output_checkpoint
from dpops.sandbox import landlock_abi


def test_render_escapes_every_string_and_has_no_script():
    row = ValidationRow(run_name="<script>alert(1)</script>", run_time="t", suite='s"><img src=x onerror=1>',
                        success=False, evaluated=1, failed=["expect_x(column=<b>)"], page='validations/a".html')
    page = render([row])
    assert "<script>alert" not in page and "<img src=x" not in page and "<b>)" not in page
    assert "<script" not in page and "default-src 'none'" in page


def _spec():
    return types.SimpleNamespace(name="r", partitions=types.SimpleNamespace(columns=["region"]),
                                 public_partitions=lambda: [("north",), ("south",)],
                                 postprocess=types.SimpleNamespace(suppress_below=None))


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    if not landlock_abi():
        pytest.skip("no Landlock: team suites are refused on this kernel")
    tmp = tmp_path_factory.mktemp("gxdocs")
    data = tmp / "data.parquet"
    pd.DataFrame({"region": ["north", "south"], "count": [10.0, 20.0], "count_std": [1.0, 1.0],
                  "count_ci95_low": [8.0, 18.0], "count_ci95_high": [12.0, 22.0]}).to_parquet(data)
    root = tmp / "proj"
    run_output_checkpoint(root, _spec(), data, run_id="run-pass")
    suite = root / "gx" / "expectations" / "output" / "all" / "big.json"
    suite.parent.mkdir(parents=True)
    suite.write_text(json.dumps({"name": "output.all.big", "expectations": [
        {"type": "expect_column_min_to_be_between", "kwargs": {"column": "count", "min_value": 1000}}]}))
    with pytest.raises(IntegrityError, match="output.all.big"):
        run_output_checkpoint(root, _spec(), data, run_id="run-fail")
    return root


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from browser_support import Browser, require_chromium

    b = Browser(require_chromium(), tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


def _open_offline(browser, path: Path):
    page = browser.open("about:blank")
    page.send("Network.enable")
    page.send("Network.emulateNetworkConditions", offline=True, latency=0, downloadThroughput=-1,
              uploadThroughput=-1)
    page.navigate(path.resolve().as_uri())
    page.pump(1.0)
    requests = [e["params"]["request"]["url"] for e in page.events if e.get("method") == "Network.requestWillBeSent"]
    return page, requests


def test_index_lists_every_validation_from_the_files(project):
    text = data_docs_index(project).read_text()
    assert "run-pass" in text and "run-fail" in text and "expect_column_min_to_be_between(column=count)" in text
    assert (data_docs_index(project).parent / "gx_index.html").is_file()


def test_data_docs_render_offline_in_chromium(project, browser):
    page, requests = _open_offline(browser, data_docs_index(project))
    try:
        assert requests and all(u.startswith("file://") for u in requests), requests
        rows = page.evaluate("Array.from(document.querySelectorAll('#validations tbody tr')).map(r => r.innerText)")
        assert len(rows) == 3, rows  # run-pass: the dpops suite; run-fail: the dpops suite and output.all.big
        assert sum("FAILED" in r for r in rows) == 1 and any("run-fail" in r and "output.all.big" in r for r in rows)
        assert page.evaluate("getComputedStyle(document.querySelector('th')).backgroundColor") == "rgb(243, 243, 243)"
        links = page.evaluate("Array.from(document.querySelectorAll('#validations a')).map(a => a.href)")
        assert len(links) == 3 and all(Path(u.removeprefix("file://")).is_file() for u in links), links
        assert page.console_errors() == []
    finally:
        page.close()


def test_gx_own_index_needs_the_network(project, browser):
    """Negative control: GX's index asks for CDN assets, which an offline host cannot load."""
    page, requests = _open_offline(browser, data_docs_index(project).parent / "gx_index.html")
    try:
        assert any(u.startswith("http") for u in requests), requests
    finally:
        page.close()

"""The reviewer's HTML report over a 36-run scope built directly through the ledger API."""

from __future__ import annotations

import base64
import os
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from dpops.errors import BudgetExceeded
from dpops.ledger.budget import format_budget
from dpops.manifest import write_manifest
from dpops.report import build_report, write_report
from manifest_support import ACTOR, make_ledger, run_key, synthetic_events, synthetic_manifest


class Tables(HTMLParser):
    """Collects every table (by id) as rows of cell texts, plus images and links."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.images: list[str] = []
        self.links: list[str] = []
        self.scripts = 0
        self._table = None
        self._cell = None
        self._row = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("id", f"t{len(self.tables)}")
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
        elif tag == "img":
            self.images.append(a.get("src", ""))
        elif tag == "a":
            self.links.append(a.get("href", ""))
        elif tag in ("script", "link"):
            self.scripts += 1

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


@pytest.fixture(scope="module")
def busy_scope(tmp_path_factory):
    """36 daily runs of two releases on one rdp scope: committed, spent-unpublished, refunded, refused, restated."""
    tmp_path = tmp_path_factory.mktemp("busy")
    ledger = make_ledger(tmp_path, accountant="rdp/1", epsilon=1.0, delta=1e-7)
    mdir = tmp_path / "manifests"
    refused = 0
    for i in range(36):
        release = "daily_a" if i % 2 == 0 else "daily_b"
        key = run_key(release, i, key_id="k1" if i < 20 else "k2")
        try:
            rec = ledger.reserve(key, "purchases", synthetic_events(sigma=25.0), actor=ACTOR)
        except BudgetExceeded as exc:
            refused += 1
            write_manifest(synthetic_manifest("refused", key=key, reason=str(exc)), mdir)
            continue
        if i % 11 == 5:
            ledger.release(rec.run_id, reason="input missing: failed before any mechanism ran", actor=ACTOR)
            continue
        ledger.start(rec.run_id, actor=ACTOR)
        if i % 13 == 7:
            ledger.mark_spent_unpublished(rec.run_id, reason="noisy output failed a post-processing check", actor=ACTOR)
            continue
        ledger.commit(rec.run_id, output_uri=f"file:///out/{release}/{i}", actor=ACTOR)
        if i in (2, 3):  # late data: restate the interval with a new input fingerprint
            new = run_key(release, i, variant="late", key_id="k1")
            r2 = ledger.reserve(new, "purchases", synthetic_events(sigma=25.0), actor=ACTOR, restates=rec.run_id)
            ledger.start(r2.run_id, actor=ACTOR)
            ledger.commit(r2.run_id, output_uri=f"file:///out/{release}/{i}/v2", actor=ACTOR)
    yield ledger, mdir, refused, tmp_path
    ledger.close()


def test_report_renders_and_matches_the_ledger(busy_scope, tmp_path):
    ledger, mdir, refused, _ = busy_scope
    assert refused >= 3, "the fixture must push the scope into refusals"
    out = tmp_path / "report.html"
    write_report(ledger, "purchases", out, manifests_dir=str(mdir))
    text = out.read_text()
    p = Tables()
    p.feed(text)
    # self-contained: no scripts, no external resources, every image inline
    assert p.scripts == 0 and not re.search(r"(src|href)=['\"]https?:", text)
    assert len(p.images) == 2 and all(s.startswith("data:image/png;base64,") for s in p.images)

    status = ledger.status("purchases")
    header, row = p.tables["status"][0], p.tables["status"][1]
    for field in ("committed", "spent_unpublished", "reserved", "total", "remaining"):
        col = header.index({"spent_unpublished": "spent, unpublished"}.get(field, field))
        # shown as the CLI shows it (issue 21 item 8: the cap's precision); the exact figure is in data-value
        assert row[col] == format_budget(getattr(status, field), status.cap), field
    assert status.total <= 1.0 + 1e-12 and status.spent_unpublished > 0

    timeline = p.tables["runs"][1:]
    runs = [r for r in timeline if r[2] != "gap"]
    states = [r[2] for r in runs]
    assert len(runs) == 36 + 2  # every run, the two restatements and the refusals included
    # date order, refusals in place; each release runs every other day, so the timeline shows its gaps
    starts = [r[0][1:21] for r in timeline]
    assert starts == sorted(starts)
    assert sum(1 for r in timeline if r[2] == "gap") == 2 * (18 - 1)  # 18 intervals per release, a hole after each
    # the synthetic refusal manifests carry a stub plan and a made-up spec hash: they must not verify
    assert {r[5] for r in runs if r[2] == "refused"} == {"FAILED"}
    assert states.count("refused") == refused
    assert "released" in states and "spent_unpublished" in states
    assert len(p.tables["restatements"]) - 1 == 2
    assert len(p.tables["refused"]) - 1 == refused + states.count("released")
    assert all("budget" in r[3].lower() or "failed before" in r[3] for r in p.tables["refused"][1:])
    # refusals link to their manifests, from the timeline and from the verification table
    assert sum(1 for link in p.links if link.endswith(".json")) == 2 * refused
    assert "who is protected" in text.lower() and "a user&#x27;s purchases on one day" in text
    assert any("noise key changed" in w for w in re.findall(r"<div class='warn'>(.*?)</div>", text))


def test_accounting_comparison_orders_pld_rdp_basic(busy_scope, tmp_path):
    ledger, mdir, _, home = busy_scope
    _, data = build_report(ledger, "purchases", tmp_path / "r.html", manifests_dir=str(mdir))
    c = data.comparison
    assert {"basic/1", "rdp/1", "pld/1", "zcdp/1"} <= set(c)
    assert c["pld/1"] <= c["rdp/1"] * (1 + 1e-9)
    assert c["rdp/1"] <= c["basic/1"]
    # the scope's own accountant over the charged history is the ledger's total
    assert c["rdp/1"] == pytest.approx(ledger.status("purchases").total, rel=1e-9)


def test_report_cli_and_window(busy_scope, tmp_path):
    from dpops.cli.main import main

    ledger, mdir, _, home = busy_scope
    url = f"sqlite:///{home / 'ledger.sqlite'}"
    out = tmp_path / "window.html"
    code = main(["report", "--scope", "purchases", "--ledger", url, "--manifests", str(mdir), "--out", str(out),
                 "--from", "2024-01-01T00:00:00Z", "--to", "2024-01-06T00:00:00Z"])
    assert code == 7  # written, but the fixture's synthetic refusal manifests (stub plan) do not verify
    p = Tables()
    p.feed(out.read_text())
    assert len([r for r in p.tables["runs"][1:] if r[2] != "gap"]) == 5 + 2  # five days, two of them restated
    assert main(["report", "--scope", "nope", "--ledger", url, "--out", str(out)]) != 0


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from browser_support import Browser, require_chromium

    b = Browser(require_chromium(), tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


def test_report_screenshot(busy_scope, tmp_path, browser):
    ledger, mdir, _, home = busy_scope
    out = write_report(ledger, "purchases", tmp_path / "r.html", manifests_dir=str(mdir))
    page = browser.open(Path(out).resolve().as_uri())
    shot = page.send("Page.captureScreenshot", format="png")
    assert len(base64.b64decode(shot["data"])) > 10_000
    assert page.console_errors() == []
    page.close()


# --------------------------------------------------------------------------- issue 14 item 6: hardening


JS_NAME = "javascript:document.title='PWNED';x.json"


def _copy_manifests(mdir, dest):
    dest.mkdir()
    for f in mdir.iterdir():
        shutil.copyfile(f, dest / f.name)
    return dest


def test_a_javascript_manifest_name_is_not_a_script_link(busy_scope, tmp_path, browser):
    ledger, mdir, _, _ = busy_scope
    copy = _copy_manifests(mdir, tmp_path / "m")
    shutil.copyfile(next(copy.glob("*.refused.json")), copy / JS_NAME)
    # the report beside the manifests, as the exploit had it: the relative link is the bare file name
    out = write_report(ledger, "purchases", copy / "r.html", manifests_dir=str(copy))
    p = Tables()
    p.feed(Path(out).read_text())
    js = [h for h in p.links if "PWNED" in h]
    assert js, "the planted manifest must be linked"
    assert all(urlsplit(h).scheme == "" for h in p.links), [h for h in p.links if urlsplit(h).scheme]
    page = browser.open(Path(out).resolve().as_uri())
    assert page.console_errors() == []
    assert set(page.evaluate("Array.from(document.links).map(a => a.protocol)")) == {"file:"}
    policy = page.evaluate("document.querySelector('meta[http-equiv=Content-Security-Policy]').content")
    assert "default-src 'none'" in policy and "script-src 'none'" in policy
    page.evaluate("document.querySelector('a[href*=PWNED]').click()")
    page.pump(1.5)
    assert page.evaluate("document.title") != "PWNED"
    assert page.evaluate("location.protocol") == "file:"
    page.close()


def test_report_write_does_not_follow_planted_symlinks(busy_scope, tmp_path):
    ledger, mdir, _, _ = busy_scope
    victim, victim2 = tmp_path / "victim", tmp_path / "victim2"
    victim.write_text("precious")
    victim2.write_text("precious too")
    out_dir = tmp_path / "reports"
    out_dir.mkdir()
    os.symlink(victim, out_dir / ".r.html.tmp")  # the old predictable temp name
    os.symlink(victim2, out_dir / "r.html")  # the target itself is a symlink
    write_report(ledger, "purchases", out_dir / "r.html", manifests_dir=str(mdir))
    assert victim.read_text() == "precious" and victim2.read_text() == "precious too"
    assert not (out_dir / "r.html").is_symlink() and "<!DOCTYPE html>" in (out_dir / "r.html").read_text()
    assert sorted(p.name for p in out_dir.iterdir()) == [".r.html.tmp", "r.html"]  # no temp file left behind


# --------------------------------------------------------------------------- issue 13: the reviewer's report


@pytest.fixture(scope="module")
def reviewed_scope(tmp_path_factory):
    """Real runs of the example spec with real manifests and published files: days 0, 1 and 3 (a gap on
    day 2), one interval off the daily grid, then a refusal once the cap (4.5 with basic/1) is reached."""
    from types import SimpleNamespace

    from dpops.ledger import RunKey
    from dpops.manifest import write_run_manifest
    from dpops.noise.randomness import NoiseKey
    from dpops.release_plan import plan_release
    from dpops.spec import load_spec
    from dpops.storage import sha256_file
    from manifest_support import EXAMPLE_SPEC, day, fp

    home = tmp_path_factory.mktemp("reviewed")
    spec = load_spec(EXAMPLE_SPEC)
    plan = plan_release(spec)
    key = NoiseKey.generate(home / "noise.key")
    ledger = make_ledger(home, accountant="basic/1", epsilon=4.5, delta=1e-7)
    mdir = home / "manifests"
    intervals = [day(0), day(1), day(3), ("2024-01-05T12:00:00Z", "2024-01-06T12:00:00Z"), day(6)]
    refused = None
    for i, (s, e) in enumerate(intervals):
        rk = RunKey(release=spec.name, spec_hash=spec.spec_hash, interval_start=s, interval_end=e,
                    input_fingerprint=fp(f"in/{i}"), key_id=key.key_id)
        ctx = SimpleNamespace(spec=spec, run_key=rk, plan=plan, randomness="keyed")
        try:
            rec = ledger.reserve(rk, "purchases", plan.events, actor=ACTOR, details={"randomness": "keyed"})
        except BudgetExceeded as exc:
            refused = write_run_manifest(ctx, ledger, {"state": "refused", "reason": str(exc)}, manifests_dir=mdir)
            continue
        ledger.start(rec.run_id, actor=ACTOR)
        out = home / "published" / f"v{i}"
        out.mkdir(parents=True)
        (out / "data.parquet").write_bytes(f"noisy values {i}".encode())
        fps = {"data.parquet": "hmac-sha256:" + key.hmac((out / "data.parquet").read_bytes()).hex()}
        path = write_run_manifest(ctx, ledger, {"state": "published", "output_uri": out.as_uri()},
                                  manifests_dir=mdir, output_fingerprints=fps)
        ledger.commit(rec.run_id, output_uri=out.as_uri(), actor=ACTOR,
                      details={"files": {"data.parquet": sha256_file(out / "data.parquet")},
                               "manifest": {"file": os.path.basename(path), "sha256": sha256_file(Path(path))}})
    assert refused is not None, "the fixture must reach the cap"
    yield SimpleNamespace(ledger=ledger, mdir=mdir, key=key, home=home, url=f"sqlite:///{home / 'ledger.sqlite'}",
                          refused=refused)
    ledger.close()


def _ledger_json(url, *args, capsys):
    import json

    from dpops.cli.main import main

    capsys.readouterr()
    assert main(["ledger", "--ledger", url, *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_reviewer_report_in_chromium(reviewed_scope, tmp_path, browser, capsys):
    import json

    from dpops.cli.main import main
    from dpops.manifest import read_manifest

    rs = reviewed_scope
    out = tmp_path / "review.html"
    assert main(["report", "--scope", "purchases", "--ledger", rs.url, "--manifests", str(rs.mdir), "--out", str(out),
                 "--key-file", str(rs.home / "noise.key")]) == 0
    status = _ledger_json(rs.url, "status", "purchases", capsys=capsys)
    page = browser.open(out.resolve().as_uri())
    assert page.console_errors() == []
    # provenance is the first section, and its facts are the ledger's
    assert page.evaluate("document.querySelector('h2').textContent") == "Provenance"
    prov = page.evaluate("Object.fromEntries(Array.from(document.querySelectorAll('#provenance tr'))"
                         ".map(r => [r.dataset.field, r.cells[1].textContent]))")
    head = rs.ledger.verify().head_hash
    assert head in prov["head_hash"] and prov["ledger_verify"].startswith("verified")
    assert prov["checkpoint"].startswith("none configured") and "sqlite://" in prov["ledger_url"]
    assert prov["manifests"].startswith("5 verified") and "0 FAILED" in prov["manifests"]
    assert prov["files"].startswith("4 match") and "0 CHANGED" in prov["files"]
    # the budget table equals `dpops ledger status --json`
    cells = page.evaluate("Object.fromEntries(Array.from(document.querySelectorAll('#status td[data-field]'))"
                          ".map(td => [td.dataset.field, td.querySelector('[data-value]').dataset.value]))")
    # data-value holds the exact float; --json shows the rounded figure people read and keeps it under "exact"
    for f in ("committed", "spent_unpublished", "reserved", "total", "remaining"):
        assert float(cells[f]) == pytest.approx(status.get("exact", {}).get(f, status[f]), rel=1e-11), f
    # the timeline: date order, the refusal in place, the gap and the off-grid interval flagged
    rows = page.evaluate("Array.from(document.querySelectorAll('#runs tr[data-kind]')).map(r => "
                         "({kind: r.dataset.kind, run: r.dataset.run || '', cells: Array.from(r.cells).map(c => "
                         "(c.querySelector('[data-value]') || {dataset: {value: c.textContent}}).dataset.value)}))")
    starts = [r["cells"][0][1:21] for r in rows]
    assert starts == sorted(starts)
    assert [r["cells"][2] for r in rows] == ["committed", "committed", "gap", "committed", "gap", "committed", "gap",
                                              "refused"]  # the off-grid interval leaves half-day gaps either side
    assert "misaligned" in rows[5]["cells"][4] and rows[2]["cells"][4].startswith("gap")
    assert not any(r["cells"][4] for r in rows if r["kind"] == "run" and r is not rows[5])
    assert all(r["cells"][5] == "verified" for r in rows if r["kind"] == "run")
    # per release: each figure equals its manifest
    blocks = page.evaluate("Array.from(document.querySelectorAll('#releases .release')).map(b => ({run: b.dataset.run, "
                           "trusted: b.dataset.trusted, eps: b.querySelector('[data-field=run_epsilon] [data-value]').dataset.value, "
                           "total: b.querySelector('[data-field=scope_total_after] [data-value]').dataset.value, "
                           "acct: b.querySelector('[data-field=accountant]').textContent, "
                           "mech: b.querySelectorAll('table.mechanisms tr').length - 1, text: b.textContent}))")
    manifests = {m["run_id"]: m for m in (read_manifest(p) for p in rs.mdir.glob("*.json"))}
    assert len(blocks) == 5
    for b in blocks:
        m = manifests[b["run"]]
        assert b["trusted"] == "true"
        assert float(b["eps"]) == pytest.approx(m["privacy"]["run"]["epsilon"], rel=1e-11)
        assert float(b["total"]) == pytest.approx(max(x["total"] for x in m["privacy"]["scope"]["buckets"]), rel=1e-11)
        assert b["acct"] == m["accountant"]["ref"] == "basic/1"
        assert b["mech"] == sum(len(x.get("vectors") or []) for x in m["release_plan"]["metrics"]) > 0
        assert m["privacy_unit"]["description"] in b["text"]
    # the committed runs' epsilons in the timeline equal the ledger's
    for r in rows:
        if r["kind"] == "run" and r["cells"][2] == "committed":
            assert float(r["cells"][3]) == pytest.approx(rs.ledger.run(r["run"]).epsilon, rel=1e-11)
    page.close()


def test_forged_or_edited_outputs_are_marked_not_trusted(reviewed_scope, tmp_path):
    """A forged manifest (noise std divided by 100) and an edited published file both show as FAILED."""
    import json

    from dpops.manifest import read_manifest

    rs = reviewed_scope
    copy = _copy_manifests(rs.mdir, tmp_path / "m")
    target = sorted(p for p in copy.glob("*.published.json"))[0]
    m = read_manifest(target)
    vec = next(x for x in m["release_plan"]["metrics"] if x.get("vectors"))["vectors"][0]
    forged_std = vec["std"] / 100
    vec["std"] = forged_std
    os.chmod(target, 0o644)
    target.write_text(json.dumps(m))
    _, data = build_report(rs.ledger, "purchases", tmp_path / "r.html", manifests_dir=str(copy), key=rs.key)
    text = write_report(rs.ledger, "purchases", tmp_path / "r.html", manifests_dir=str(copy), key=rs.key)
    html = Path(text).read_text()
    assert data.checks[str(target)].status == "FAILED"
    assert data.provenance["manifests"]["failed"] == 1
    assert f"data-run='{m['run_id']}' data-trusted='false'" in html
    p = Tables()
    p.feed(html)
    # the forged number is never shown as a fact (only quoted in the verification failure itself)
    cut = html.index("<table id='verification'>")
    facts = html[:cut] + html[html.index("</table>", cut):]
    assert f"{forged_std:.6g}" not in facts
    assert all(float(r[5]) == pytest.approx(vec["std"] * 100) for r in p.tables["noise"][1:] if r[3] == vec["name"])
    row = next(r for r in p.tables["verification"][1:] if r[0] == target.name)
    assert row[1] == "FAILED" and "release_plan.metrics" in row[4]
    from dpops.cli.main import main

    args = ["report", "--scope", "purchases", "--ledger", rs.url, "--out", str(tmp_path / "cli.html")]
    assert main(args + ["--manifests", str(copy)]) == 7 and (tmp_path / "cli.html").is_file()
    assert main(args + ["--manifests", str(rs.mdir)]) == 0

    # now an edited published file, manifests intact
    victim = next((rs.home / "published").rglob("data.parquet"))
    original = victim.read_bytes()
    try:
        victim.write_bytes(original + b" edited")
        _, data = build_report(rs.ledger, "purchases", tmp_path / "r2.html", manifests_dir=str(rs.mdir), key=rs.key)
        assert data.provenance["files"]["changed"] == 1
        bad = [c for c in data.checks.values() if not c.ok]
        assert len(bad) == 1 and bad[0].files == "CHANGED" and any("data.parquet" in p for p in bad[0].problems)
    finally:
        victim.write_bytes(original)


def test_ledger_url_in_the_report_has_no_credentials():
    from dpops.ledger.backend import redact  # the one redaction (issue 19 item 11); the report uses public=True

    assert redact("postgresql://dpops_app:s3cret@db.internal:5432/ledger?sslmode=require&password=pw",
                  public=True) == "postgresql://db.internal:5432/ledger?sslmode=require"
    assert redact("sqlite:////var/lib/dpops/ledger.sqlite", public=True) == "sqlite:////var/lib/dpops/ledger.sqlite"


def test_release_details_explain_absent_sensitivities(reviewed_scope, tmp_path):
    """Issue 21 item 12: a Laplace vector has no L2 sensitivity; the report says why ("n/a (pure ε-DP: ...")
    instead of printing ``inf``; the same for a Gaussian's L1."""
    text, _ = build_report(reviewed_scope.ledger, "purchases", tmp_path / "r.html",
                           manifests_dir=str(reviewed_scope.mdir), key=reviewed_scope.key)
    p = Tables()
    p.feed(text)
    mech = [row for name, rows in p.tables.items() if name.startswith("t") for row in rows
            if len(row) == 7 and row[0] != "metric"]
    assert mech, "the fixture's manifests must list mechanisms"
    assert all("inf" not in cell.split() for row in mech for cell in row), mech
    for row in mech:
        if "laplace" in row[2].lower():
            assert row[6].startswith("n/a (pure ε-DP"), row
        if "gauss" in row[2].lower():
            assert row[5].startswith("n/a (Gaussian"), row


def test_epsilon_column_and_bars_count_only_charges(busy_scope, tmp_path):
    """Issue 28 item 4: refused and refunded runs charged nothing, so the timeline's ε column and the
    per-interval bars show 0 for them; the column then adds up to the sum of the ledger's charged runs."""
    from dpops.ledger.model import CHARGED_STATES

    ledger, mdir, _, _ = busy_scope
    text, data = build_report(ledger, "purchases", tmp_path / "r.html", manifests_dir=str(mdir))
    cells = re.findall(r"<tr data-kind='run' data-run='([0-9a-f]+)'>.*?<td class='state-([a-z_]+)'.*?"
                       r"data-field='epsilon'><span data-value='([^']+)'>", text)
    assert len(cells) == 38
    charged = {r.run_id: r.epsilon for r in ledger.runs() if r.state in CHARGED_STATES}
    for run_id, state, value in cells:
        assert float(value) == (charged[run_id] if state in CHARGED_STATES else 0.0), (run_id, state)
    assert {s for _, s, _ in cells} >= {"refused", "released"}
    column = sum(float(v) for *_, v in cells)
    assert column == pytest.approx(sum(charged.values()), rel=1e-12)
    shown = re.search(r"data-field='column_sum'><span data-value='([^']+)'>", text)
    assert shown and float(shown.group(1)) == pytest.approx(column, rel=1e-12)
    from dpops.report.plots import per_interval_bars

    bars = per_interval_bars(data)
    assert len(bars) == 38 and sum(b[1] for b in bars) == pytest.approx(column, rel=1e-12)
    assert all(eps == 0.0 for _, eps, state in bars if state not in CHARGED_STATES)

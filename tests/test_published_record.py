"""Issue 25 item 10: the published record is accepted only where the ledger committed THAT interval and version.

- A forged version on an interval the ledger never committed (a refused day, a never-run day) fails
  ``release status`` (exit 7), is ``forged`` in ``dpops gaps`` (exit 7) and on the budget page, which keeps
  the day's refusal in view. Before the fix status exited 0, gaps said "published" and the page dropped it.
- ``current`` moved back to v1 after the newer v2 was *damaged* (not deleted) fails the reader's check.
- A version signed by another deployment with the same signing key fails: the /2 binding names the output
  root and the ledger id (``Ledger.ledger_id``, the genesis entry hash), and a reader can pin the ledger id.
- A version bound by an older dpops (/1 binding) still verifies, with a "not checked" note; a reader that
  pins the ledger id refuses it (a /1 binding cannot say which ledger committed it).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli_support import make_env
from dpops.cli.main import main
from dpops.ledger import open_ledger
from dpops.manifest.sign import generate_signing_key

RELEASE = "purchases_test"
DAY1 = "20240101T000000Z_20240102T000000Z"
DAY2 = "20240102T000000Z_20240103T000000Z"
FORGED_RUN = "f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0"


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, (out.out if "--json" in argv else out.out + out.err)


@pytest.fixture
def signing(tmp_path, monkeypatch):
    priv, pub = tmp_path / "publisher.pem", tmp_path / "publisher.pub.pem"
    generate_signing_key(priv, pub)
    monkeypatch.setenv("DPOPS_MANIFEST_SIGNING_KEY", str(priv))
    monkeypatch.delenv("DPOPS_MANIFEST_PUBLIC_KEY", raising=False)
    monkeypatch.delenv("DPOPS_LEDGER_ID", raising=False)
    return priv, pub


def _publish(capsys, env, day: str) -> dict:
    code, out = _run(capsys, "release", "run", str(env.spec), "--interval", day, "--ledger", env.url,
                     "--key-file", str(env.key), "--publish", "--no-gx-checks", "--json")
    assert code == 0, out
    return json.loads(out)


def _interval_dir(env, slug: str) -> Path:
    (found,) = list(env.root.rglob(f"published/{RELEASE}/{DAY1}"))
    return found.parent / slug


def _forge_on(interval: Path, genuine_v1: Path, slug: str) -> None:
    """A writer of published/ copies a genuine version to an interval the ledger never committed, with exact
    counts, a marker naming that interval and a run id the ledger never saw, and a ``current`` pointer."""
    buf = io.BytesIO()
    pq.write_table(pa.table({"region": ["north", "south"], "count": [2.0, 1.0]}), buf)
    interval.mkdir(parents=True)
    v1 = interval / "v1"
    v1.mkdir()
    (v1 / "data.parquet").write_bytes(buf.getvalue())
    shutil.copyfile(genuine_v1 / "summary.json", v1 / "summary.json")
    marker = json.loads((genuine_v1 / "_PUBLISHED.json").read_text())
    marker.update({"run_id": FORGED_RUN, "interval": slug,
                   "files": {n: hashlib.sha256((v1 / n).read_bytes()).hexdigest()
                             for n in ("data.parquet", "summary.json")}})
    (v1 / "_PUBLISHED.json").write_text(json.dumps(marker))
    os.symlink("v1", interval / "current")


def test_a_forged_version_on_a_refused_day_fails_status_gaps_and_the_budget_page(tmp_path, monkeypatch, capsys,
                                                                                signing):
    from dpops.budget_view import budget_page

    env = make_env(tmp_path, monkeypatch, cap=0.5)  # one run of 0.5 fills the cap: day 2 is refused
    _publish(capsys, env, "2024-01-01")
    code, out = _run(capsys, "release", "run", str(env.spec), "--interval", "2024-01-02", "--ledger", env.url,
                     "--key-file", str(env.key), "--publish", "--no-gx-checks")
    assert code == 5, out  # refused by the cap: nothing charged, nothing committed
    day1 = _interval_dir(env, DAY1)
    _forge_on(_interval_dir(env, DAY2), day1 / "v1", DAY2)

    code, out = _run(capsys, "release", "status", str(env.spec), "--interval", "2024-01-02", "--ledger", env.url,
                     "--key-file", str(env.key))
    assert code == 7 and "v1" in out and "not committed in the ledger" in out, out
    code, out = _run(capsys, "gaps", str(env.spec), "--from", "2024-01-01", "--to", "2024-01-03", "--ledger",
                     env.url, "--json")
    assert code == 7, out
    doc = json.loads(out)
    items = {i["interval_start"]: i for i in (doc.get("items") or doc.get("details", {}).get("items", []))}
    assert items["2024-01-02T00:00:00Z"]["status"] == "forged", items
    assert "refused" in items["2024-01-02T00:00:00Z"]["detail"], items
    manifests = next(env.root.rglob(f"manifests/{RELEASE}"))
    with open_ledger(env.url) as led:
        page = budget_page(led, manifests, [str(env.spec)])
    (opened,) = [o for o in page.open_intervals if o.interval_start.startswith("2024-01-02")]
    assert opened.status == "forged" and "refused" in opened.reason, page.open_intervals
    # day 1 is genuine and stays published
    code, out = _run(capsys, "release", "status", str(env.spec), "--interval", "2024-01-01", "--ledger", env.url,
                     "--key-file", str(env.key))
    assert code == 0 and "published files: ok" in out, out


def test_a_forged_version_on_a_never_run_day_fails_release_status(tmp_path, monkeypatch, capsys, signing):
    env = make_env(tmp_path, monkeypatch)
    _publish(capsys, env, "2024-01-01")
    _forge_on(_interval_dir(env, DAY2), _interval_dir(env, DAY1) / "v1", DAY2)
    code, out = _run(capsys, "release", "status", str(env.spec), "--interval", "2024-01-02", "--ledger", env.url)
    assert code == 7 and "not committed in the ledger" in out, out


def test_current_moved_back_past_a_damaged_newer_version_fails_every_check(tmp_path, monkeypatch, capsys, signing):
    """v2 is the restatement (newest committed); the attacker damages v2 (edits its data, or removes its marker)
    and points current back at v1. The reader's check used to pass: 'no newer VALIDLY bound version'."""
    from test_runs import write_input

    _, pub = signing
    env = make_env(tmp_path, monkeypatch)
    _publish(capsys, env, "2024-01-01")
    write_input(env.root, "2024-01-01", amounts=(5.0, 6.0, 7.0, 8.0))  # a corrected input: a restatement
    code, out = _run(capsys, "release", "restate", str(env.spec), "--interval", "2024-01-01", "--ledger", env.url,
                     "--key-file", str(env.key), "--no-gx-checks")
    assert code == 0, out
    day1 = _interval_dir(env, DAY1)
    assert os.readlink(day1 / "current") == "v2"
    root = str(day1.parent.parent.parent)
    reader = ["release", "check-pointer", "--root", root, "--release", RELEASE, "--interval",
              "2024-01-01/2024-01-02", "--public-key", str(pub)]
    assert _run(capsys, *reader)[0] == 0

    for damage in ("data", "marker"):
        if damage == "data":
            (day1 / "v2" / "data.parquet").write_bytes(b"damaged")
        else:
            shutil.move(str(day1 / "v2" / "_PUBLISHED.json"), str(tmp_path / "v2-marker.json"))
        os.unlink(day1 / "current")
        os.symlink("v1", day1 / "current")
        code, out = _run(capsys, *reader)
        assert code == 7 and "newer version v2" in out, (damage, out)
        code, out = _run(capsys, "release", "status", str(env.spec), "--interval", "2024-01-01", "--ledger", env.url)
        assert code == 7, (damage, out)


def test_a_version_signed_by_another_deployment_with_the_same_key_fails(tmp_path, monkeypatch, capsys, signing):
    """Deployment B (its own ledger and root, the same signing and noise key) publishes day 1; its interval
    directory is copied into deployment A's root. A's reader check refuses it: another output root. With the
    same root string (both deployments mount /data/out), the ledger-id pin refuses it."""
    _, pub = signing
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = make_env(tmp_path / "a", monkeypatch)
    b = make_env(tmp_path / "b", monkeypatch)
    shutil.copyfile(a.key, b.key)  # the same noise key too: the MAC verifies on either side
    _publish(capsys, b, "2024-01-01")
    b_day1 = _interval_dir(b, DAY1)
    a_published = a.root / "out" / "published" / RELEASE  # A's configured root, where its readers look
    assert str(b_day1.parent.parent.parent).endswith("out"), b_day1
    a_published.mkdir(parents=True)
    shutil.copytree(b_day1, a_published / DAY1, symlinks=True)
    reader = ["release", "check-pointer", "--release", RELEASE, "--interval", "2024-01-01/2024-01-02",
              "--public-key", str(pub)]
    code, out = _run(capsys, *reader, "--root", str(a.root / "out"))
    assert code == 7 and "output_root" in out, out
    # Same root, other ledger: B's own root read by a reader pinned to A's ledger.
    with open_ledger(a.url) as la, open_ledger(b.url) as lb:
        a_id, b_id = la.ledger_id(), lb.ledger_id()
    assert a_id and b_id and a_id != b_id
    b_root = str(b_day1.parent.parent.parent)
    code, out = _run(capsys, *reader, "--root", b_root, "--ledger-id", a_id)
    assert code == 7 and "ledger_id" in out, out
    code, out = _run(capsys, *reader, "--root", b_root, "--ledger-id", b_id)
    assert code == 0 and "binding verified" in out, out
    # A's ledger path refuses the copy as well (a run A's ledger never committed).
    code, out = _run(capsys, "release", "status", str(a.spec), "--interval", "2024-01-01", "--ledger", a.url)
    assert code == 7 and "not committed in the ledger" in out, out


def test_a_version_bound_by_an_older_dpops_still_verifies(tmp_path, monkeypatch, capsys, signing):
    """A /1 binding (no output root, no ledger id), as dpops wrote before: its MAC and signature still verify
    (reader's check exit 0, with a note), release status passes; a reader pinning the ledger id refuses it."""
    from dpops.keyref import resolve_key
    from dpops.manifest.sign import load_private_key
    from dpops.storage.published import BINDING_VERSION_1, binding_payload

    priv, pub = signing
    env = make_env(tmp_path, monkeypatch)
    _publish(capsys, env, "2024-01-01")
    day1 = _interval_dir(env, DAY1)
    marker = json.loads((day1 / "v1" / "_PUBLISHED.json").read_text())
    b = marker["binding"]
    payload = binding_payload(release=b["release"], interval=b["interval"], version=b["published_version"],
                              run_id=b["run_id"], ledger_entry_hash=b["ledger_entry_hash"], files=b["files"],
                              binding=BINDING_VERSION_1)
    old = {k: v for k, v in b.items() if k not in ("output_root", "ledger_id")}
    old.update(version=BINDING_VERSION_1, mac=resolve_key(str(env.key)).binding_mac(payload))
    old["signature"]["value"] = base64.b64encode(load_private_key(priv).sign(payload)).decode("ascii")
    marker["binding"] = old
    (day1 / "v1" / "_PUBLISHED.json").write_text(json.dumps(marker))
    root = str(day1.parent.parent.parent)
    reader = ["release", "check-pointer", "--root", root, "--release", RELEASE, "--interval", "2024-01-01/2024-01-02"]
    code, out = _run(capsys, *reader, "--public-key", str(pub))
    assert code == 0 and "not checked" in out and BINDING_VERSION_1 in out, out
    code, out = _run(capsys, *reader, "--key-file", str(env.key))
    assert code == 0, out
    code, out = _run(capsys, "release", "status", str(env.spec), "--interval", "2024-01-01", "--ledger", env.url,
                     "--key-file", str(env.key))
    assert code == 0 and "published files: ok" in out, out
    with open_ledger(env.url) as led:
        lid = led.ledger_id()
    code, out = _run(capsys, *reader, "--public-key", str(pub), "--ledger-id", str(lid))
    assert code == 7 and BINDING_VERSION_1 in out, out


def test_a_run_next_to_a_stray_forged_version_is_refused_before_anything_is_reserved(tmp_path, monkeypatch, capsys,
                                                                                     signing):
    """A forged version on a never-run day without a ``current`` pointer used to be published next to: the run
    charged 0.5, wrote v2 beside the forged v1, and every check then failed. Now the run is refused (exit 7)
    before the reservation: nothing charged, nothing published."""
    env = make_env(tmp_path, monkeypatch)
    _publish(capsys, env, "2024-01-01")
    day2 = _interval_dir(env, DAY2)
    _forge_on(day2, _interval_dir(env, DAY1) / "v1", DAY2)
    os.unlink(day2 / "current")  # only the stray version
    code, out = _run(capsys, "release", "run", str(env.spec), "--interval", "2024-01-02", "--ledger", env.url,
                     "--key-file", str(env.key), "--publish", "--no-gx-checks")
    assert code == 7 and "nothing reserved" in out and "not committed in the ledger" in out, out
    with open_ledger(env.url) as led:
        assert [r.key.interval_start[:10] for r in led.runs(release=RELEASE)] == ["2024-01-01"]
        assert led.status("shop").total == pytest.approx(0.5)
    assert sorted(p.name for p in day2.iterdir()) == ["v1"]

"""Issue 19 item 1: which timestamp puts a row in a bucket is part of a scope's unit definition.

The exploit: one day-bucketed scope, two specs over the same rows (``data/all.parquet``), one placing
rows by purchase time ``ts``, the other by ``shipped_at``. Both published at epsilon=1 in the same
day buckets, so one user's rows of one day were charged to two days' buckets while feeding both
releases (audited epsilon >= 1.61 against a per-day cap of 1). Now the scope records its time rule
and the second spec is refused before reservation, through the real CLI, with the ledger unchanged.
"""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from dpops.cli.main import main
from dpops.events import canonical_json
from dpops.ledger import open_ledger
from dpops.ledger.schema import GENESIS_HASH, entry_hash
from dpops.noise.randomness import NoiseKey

DAY1, DAY2 = "2024-01-01/2024-01-02", "2024-01-02/2024-01-03"


def _write_data(root: Path) -> None:
    """Rows over two days; each order ships 0-30 hours after it is placed, so ts and shipped_at often disagree."""
    start = datetime(2024, 1, 1, tzinfo=UTC)
    n = 120
    ts = [start + timedelta(minutes=23 * i) for i in range(n)]
    shipped = [t + timedelta(hours=(7 * i) % 31) for i, t in enumerate(ts)]
    (root / "data").mkdir(exist_ok=True)
    pq.write_table(pa.table({
        "user_id": [f"u{i % 40}" for i in range(n)],
        "region": ["north" if i % 3 else "south" for i in range(n)],
        "ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
        "shipped_at": pa.array(shipped, pa.timestamp("us", tz="UTC")),
    }), root / "data" / "all.parquet")


def _spec(root: Path, name: str, time_column: str) -> Path:
    doc = {
        "name": name,
        "input": {"path": "data/all.parquet", "format": "parquet",
                  "columns": {"user_id": "string", "region": "string", time_column: "timestamp"},
                  "time_column": time_column},
        "privacy_unit": {"column": "user_id", "description": "a user's orders on one day", "adjacency": "add_remove",
                         "period": "day"},
        "budget": {"scope": "orders", "epsilon": 1.0, "delta": 0},
        "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 5},
        "partitions": {"columns": ["region"], "public": ["north", "south"]},
        "metrics": [{"type": "count"}],
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _create_scope(capsys, url: str, *extra: str) -> tuple[int, str, str]:
    return _cli(capsys, "ledger", "--ledger", url, "scope", "create", "orders", "--unit", "a user's orders on one day",
                "--unit-column", "user_id", "--epsilon", "1", "--delta", "0", "--accountant", "basic",
                "--bucket", "day", "--unit-period", "day", "--adjacency", "add_remove", *extra)


def _ledger_state(capsys, url: str) -> tuple[list, dict]:
    code, out, _ = _cli(capsys, "ledger", "--ledger", url, "history", "--json")
    assert code == 0
    entries = json.loads(out)["entries"]
    code, out, _ = _cli(capsys, "ledger", "--ledger", url, "status", "orders", "--json")
    assert code == 0
    return entries, json.loads(out)


@pytest.fixture
def env(tmp_path, monkeypatch):
    for var in ("DPOPS_LEDGER_URL", "DPOPS_MANIFESTS_DIR", "DPOPS_NOISE_KEY_FILE", "DPOPS_DATA_ROOTS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("COLUMNS", "300")  # rich would abbreviate the scope table's cells
    _write_data(tmp_path)
    key = tmp_path / "noise.key"
    NoiseKey.generate(key)
    return tmp_path, f"sqlite:///{tmp_path / 'ledger.sqlite'}", str(key)


def _run(capsys, spec: Path, interval: str, url: str, key: str) -> tuple[int, str, str]:
    return _cli(capsys, "release", "run", str(spec), "--interval", interval, "--key-file", key, "--ledger", url,
                "--publish", "--no-gx-checks", "--no-progress", "--json")


def test_a_second_time_column_on_one_day_scope_is_refused_before_reservation(env, capsys):
    """The two-spec exploit through the real CLI: by_purchase (ts) publishes; by_shipping (shipped_at) on the
    same scope and days is refused before any reservation, naming both time rules; the ledger is unchanged."""
    root, url, key = env
    code, _, err = _create_scope(capsys, url, "--time-column", "ts")
    assert code == 0, err
    by_purchase = _spec(root, "by_purchase", "ts")
    by_shipping = _spec(root, "by_shipping", "shipped_at")
    for iv in (DAY1, DAY2):
        code, out, err = _run(capsys, by_purchase, iv, url, key)
        assert code == 0, err
        assert json.loads(out)["state"] == "published"
    before = _ledger_state(capsys, url)
    for iv in (DAY1, DAY2):
        code, out, err = _run(capsys, by_shipping, iv, url, key)
        assert code == 3, (out, err)  # SpecError
        assert "shipped_at (timestamp, naive=UTC, dpops.time-filter/1)" in err
        assert "ts (timestamp, naive=UTC, dpops.time-filter/1)" in err
        assert "nothing was reserved" in err and "--time-column shipped_at" in err
    assert _ledger_state(capsys, url) == before  # not one entry, not one charge
    assert _cli(capsys, "ledger", "--ledger", url, "verify")[0] == 0

    # the manifest carries the time rule, and manifest verify checks it against the spec and the ledger
    manifest = next((root / "out/manifests/by_purchase").glob("*.published.json"))
    doc = json.loads(manifest.read_text())
    assert doc["privacy"]["scope"]["definition"]["time"] == {
        "column": "ts", "type": "timestamp", "zone": "naive=UTC", "filter": "dpops.time-filter/1"}
    code, _, err = _cli(capsys, "manifest", "verify", str(manifest), "--ledger", url, "--key-file", key)
    assert code == 0, err
    doc["privacy"]["scope"]["definition"]["time"]["column"] = "shipped_at"
    edited = root / "edited.json"
    edited.write_text(json.dumps(doc))
    code, out, err = _cli(capsys, "manifest", "verify", str(edited), "--ledger", url, "--key-file", key)
    assert code != 0 and "privacy.scope.definition.time" in out + err


def test_editing_the_time_column_between_days_is_refused(env, capsys):
    """The same exploit with one spec edited between day 1 and day 2."""
    root, url, key = env
    assert _create_scope(capsys, url, "--time-column", "ts")[0] == 0
    spec = _spec(root, "daily_orders", "ts")
    assert _run(capsys, spec, DAY1, url, key)[0] == 0
    before = _ledger_state(capsys, url)
    spec.write_text(_spec(root, "daily_orders", "shipped_at").read_text())
    code, _, err = _run(capsys, spec, DAY2, url, key)
    assert code == 3 and "that scope 'orders' records" in err and "nothing was reserved" in err
    assert _ledger_state(capsys, url) == before


def test_scope_show_and_create_record_the_time_rule(env, capsys):
    root, url, _ = env
    # a new bucketed scope must say which column's time puts a row in a day
    code, _, err = _create_scope(capsys, url)
    assert code == 3 and "--time-column" in err
    assert _create_scope(capsys, url, "--time-column", "ts")[0] == 0
    assert _create_scope(capsys, url, "--time-column", "ts")[0] == 0  # idempotent when identical
    code, _, err = _create_scope(capsys, url, "--time-column", "shipped_at")
    assert code == 6 and "different definition" in err  # a recorded rule is never changed by create
    code, out, _ = _cli(capsys, "ledger", "--ledger", url, "scope", "show", "orders", "--json")
    shown = json.loads(out)["scopes"][0]
    rule = {"column": "ts", "type": "timestamp", "zone": "naive=UTC", "filter": "dpops.time-filter/1"}
    assert shown["time_rule"] == rule and shown["unit_definition"]["time"] == rule
    code, out, _ = _cli(capsys, "ledger", "--ledger", url, "scope", "show")
    assert code == 0 and "ts (timestamp, naive=UTC, dpops.time-filter/1)" in out
    code, _, err = _cli(capsys, "ledger", "--ledger", url, "scope", "pin-time", "orders", "--time-column",
                        "shipped_at", "--reason", "try to move it")
    assert code == 6 and "never changed" in err


LEGACY_SCOPE = {"name": "orders", "unit": "a user's orders on one day", "unit_column": "user_id", "epsilon": 1.0,
                "delta": 0.0, "rho": None, "accountant": "basic/1", "bucket": "day", "population": None, "owner": "",
                "description": "", "unit_period": "day", "adjacency": "add_remove"}


def _rehash(docs: list[dict]) -> list[str]:
    """Export lines with every hash recomputed, as ``Ledger.export`` documents it (sha256 of prev_hash + body)."""
    prev, lines = GENESIS_HASH, []
    for doc in docs:
        body = {k: v for k, v in doc.items() if k not in ("prev_hash", "hash")}
        doc = {**doc, "prev_hash": prev, "hash": entry_hash(prev, canonical_json(body))}
        lines.append(canonical_json(doc))
        prev = doc["hash"]
    return lines


def _legacy_bucketed_scope(root: Path, url: str, capsys) -> None:
    """A day-bucketed scope exactly as dpops stored it before scopes recorded their time rule, loaded with
    `dpops ledger import` (so the import path replays a pre-existing scope too)."""
    export = root / "legacy.jsonl"
    export.write_text(_rehash([{"id": 1, "ts": "2024-01-01T00:00:00.000000+00:00", "kind": "scope_created",
                                "scope": "orders", "run_id": None, "buckets": [], "actor": "old-dpops",
                                "data": {"definition": LEGACY_SCOPE}}])[0] + "\n")
    assert _cli(capsys, "ledger", "--ledger", url, "init")[0] == 0
    code, _, err = _cli(capsys, "ledger", "--ledger", url, "import", str(export))
    assert code == 0, err
    with sqlite3.connect(url.removeprefix("sqlite:///")) as db:
        stored = db.execute("SELECT definition FROM scopes WHERE name = 'orders'").fetchone()[0]
    assert "time_rule" not in stored  # the older dpops' stored form, byte for byte


def test_a_legacy_bucketed_scope_refuses_until_its_owner_pins_the_rule(env, capsys):
    """A bucketed scope from before time rules: every release refused, with the command to run; the owner's
    explicit pin (an entry of its own) then admits exactly that rule, and verify/export/import replay it."""
    root, url, key = env
    _legacy_bucketed_scope(root, url, capsys)
    spec = _spec(root, "by_purchase", "ts")
    code, out, _ = _cli(capsys, "ledger", "--ledger", url, "scope", "show")
    assert "pin with dpops ledger scope pin-time orders" in out
    code, _, err = _run(capsys, spec, DAY1, url, key)
    assert code == 3 and "dpops ledger scope pin-time orders --time-column ts" in err
    assert "nothing was reserved" in err
    code, out, err = _cli(capsys, "ledger", "--ledger", url, "scope", "pin-time", "orders", "--time-column", "ts",
                          "--reason", "every release on orders so far used ts (checked in their manifests)",
                          "--actor", "owner", "--json")
    assert code == 0, err
    entries, _ = _ledger_state(capsys, url)
    assert [e["kind"] for e in entries] == ["scope_created", "scope_time_pinned"]
    assert entries[1]["actor"] == "owner" and entries[1]["data"]["after"]["time_rule"]["column"] == "ts"
    assert _run(capsys, spec, DAY1, url, key)[0] == 0
    code, _, err = _run(capsys, _spec(root, "by_shipping", "shipped_at"), DAY2, url, key)
    assert code == 3 and "that scope 'orders' records" in err
    assert _cli(capsys, "ledger", "--ledger", url, "verify")[0] == 0
    manifest = next((root / "out/manifests/by_purchase").glob("*.published.json"))
    assert _cli(capsys, "manifest", "verify", str(manifest), "--ledger", url, "--key-file", key)[0] == 0

    # export/import replays the pin: the new ledger verifies and holds the same definition
    export = root / "export.jsonl"
    assert _cli(capsys, "ledger", "--ledger", url, "export", str(export))[0] == 0
    new_url = f"sqlite:///{root / 'imported.sqlite'}"
    assert _cli(capsys, "ledger", "--ledger", new_url, "init")[0] == 0
    code, _, err = _cli(capsys, "ledger", "--ledger", new_url, "import", str(export))
    assert code == 0, err
    code, out, _ = _cli(capsys, "ledger", "--ledger", new_url, "scope", "show", "orders", "--json")
    assert json.loads(out)["scopes"][0]["time_rule"]["column"] == "ts"

    # a forged pin in an export (a cap raise smuggled in, or the rule moved by a second pin) fails the replay
    docs = [json.loads(line) for line in export.read_text().splitlines()]
    assert docs[1]["kind"] == "scope_time_pinned"
    forged = [*docs[:1], {**docs[1], "data": {**docs[1]["data"],
                                              "after": {**docs[1]["data"]["after"], "epsilon": 50.0}}}, *docs[2:]]
    moved = {**docs[1]["data"]["after"], "time_rule": {**docs[1]["data"]["after"]["time_rule"],
                                                       "column": "shipped_at"}}
    second = [*docs, {**docs[1], "id": len(docs) + 1,
                          "data": {"before": docs[1]["data"]["after"], "after": moved, "reason": "move"}}]
    for bad, needle in ((forged, "changes more than the time rule"), (second, "where none was recorded")):
        (root / "forged.jsonl").write_text("\n".join(_rehash([*bad])) + "\n")
        code, out, err = _cli(capsys, "ledger", "verify", "--export", str(root / "forged.jsonl"))
        assert code == 7 and needle in out + err, (out, err)

    # an edited cache row (the time rule moved in the scopes table) is caught by verify
    with sqlite3.connect(url.removeprefix("sqlite:///")) as db:
        row = db.execute("SELECT definition FROM scopes WHERE name = 'orders'").fetchone()[0]
        db.execute("UPDATE scopes SET definition = ? WHERE name = 'orders'",
                   (row.replace('"column":"ts"', '"column":"shipped_at"'),))
    code, out, err = _cli(capsys, "ledger", "--ledger", url, "verify")
    assert code == 7 and "scopes table row 'orders' differs" in out + err


def test_scope_create_on_a_legacy_scope_pins_its_rule(env, capsys):
    """deploy/ledger-init.sh re-runs `scope create` at every start: on a ledger from before time rules, the
    same definition with --time-column pins the rule (its own entry), so an upgrade needs no manual step."""
    root, url, _ = env
    _legacy_bucketed_scope(root, url, capsys)
    code, out, err = _create_scope(capsys, url, "--time-column", "ts", "--json")
    assert code == 0, err
    entries, _ = _ledger_state(capsys, url)
    assert [e["kind"] for e in entries] == ["scope_created", "scope_time_pinned"]
    assert _create_scope(capsys, url, "--time-column", "ts")[0] == 0  # and then idempotent
    assert len(_ledger_state(capsys, url)[0]) == 2
    assert _cli(capsys, "ledger", "--ledger", url, "verify")[0] == 0


def test_the_deploy_ledger_init_scope_records_the_example_specs_time_rule(tmp_path, capsys, monkeypatch):
    """deploy/ledger-init.sh's `scope create` line, run as written (on SQLite), records the time rule of
    deploy/specs/example_daily.yaml, and the example release is admitted by the scope it creates."""
    import shlex

    from dpops.release import unit_definition_mismatches
    from dpops.spec import load_spec

    repo = Path(__file__).resolve().parent.parent
    script = (repo / "deploy" / "ledger-init.sh").read_text().replace("\\\n", " ")
    line = next(ln for ln in script.splitlines() if ln.startswith("dpops ledger scope create"))
    argv = shlex.split(line)[1:]
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    code, _, err = _cli(capsys, argv[0], "--ledger", url, *argv[1:])
    assert code == 0, err
    monkeypatch.setenv("DPOPS_OUTPUT_ROOTS", "/data/out")
    monkeypatch.setenv("DPOPS_DATA_ROOTS", "/data/input")
    spec = load_spec(repo / "deploy" / "specs" / "example_daily.yaml")
    with open_ledger(url) as led:
        scope = led.scope(spec.budget.scope)
    assert scope.time_rule is not None and scope.time_rule.column == spec.input.time_column == "ts"
    assert unit_definition_mismatches(spec, scope) == []


def test_a_cap_change_entry_that_moves_the_time_rule_breaks_the_replay(env, capsys):
    """A forged cap_changed entry (valid hashes) that also moves the time rule is refused by verify's replay:
    only scope_time_pinned sets a rule, and only where none was recorded."""
    root, url, _ = env
    assert _create_scope(capsys, url, "--time-column", "ts")[0] == 0
    assert _cli(capsys, "ledger", "--ledger", url, "cap", "orders", "--epsilon", "2", "--reason", "board")[0] == 0
    export = root / "export.jsonl"
    assert _cli(capsys, "ledger", "--ledger", url, "export", str(export))[0] == 0
    assert _cli(capsys, "ledger", "verify", "--export", str(export))[0] == 0
    docs = [json.loads(line) for line in export.read_text().splitlines()]
    assert docs[1]["kind"] == "cap_changed"
    after = docs[1]["data"]["after"]
    docs[1]["data"]["after"] = {**after, "time_rule": {**after["time_rule"], "column": "shipped_at"}}
    (root / "forged.jsonl").write_text("\n".join(_rehash(docs)) + "\n")
    code, out, err = _cli(capsys, "ledger", "verify", "--export", str(root / "forged.jsonl"))
    assert code == 7 and "changes more than the cap" in out + err

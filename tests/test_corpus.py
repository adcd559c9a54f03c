"""The bad-input corpus (``tests/corpus/index.yaml``): every hostile spec and input through a real
``dpops release run --publish`` (forked, real plan and Beam pipeline), in a fresh directory with a
fresh SQLite ledger.

For every case: no traceback (a dpops exit code and a message naming the field/file), the expected
exit code and message fragment, nothing published by a failed run, and no ledger entry at all for a
run refused before reading data (so no budget is spent). Published cases: no NaN anywhere in the
output, exactly the expected partitions, the declared bounds respected, and the expected internal
drop counters (rows dropped, yet the interval published).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from fault_support import SCOPE, run_cli, warm_imports

CORPUS = Path(__file__).resolve().parent / "corpus"
INDEX = yaml.safe_load((CORPUS / "index.yaml").read_text(encoding="utf-8"))
BASE = yaml.safe_load((CORPUS / "base_spec.yaml").read_text(encoding="utf-8"))
INTERVAL = "2024-01-01/2024-01-02"
SLUG = "20240101T000000Z_20240102T000000Z"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", autouse=True)
def _warm():
    warm_imports()


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    from dpops.noise.randomness import NoiseKey

    path = tmp_path_factory.mktemp("key") / "noise.key"
    NoiseKey.generate(path)
    return path


def _merge(doc: dict, patch: dict) -> dict:
    out = dict(doc)
    for k, v in patch.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class Case:
    """A fresh release directory: spec, one day of input, a ledger with scope ``shop``."""

    def __init__(self, root: Path, key_file: Path):
        from dpops.ledger import ScopeDefinition, open_ledger

        self.root = root
        self.key_file = key_file
        self.url = f"sqlite:///{root / 'ledger.sqlite'}"
        (root / "data").mkdir(parents=True)
        with open_ledger(self.url) as led:
            led.create_scope(ScopeDefinition(name=SCOPE, unit="a user's purchases on one day", unit_column="user_id",
                                             epsilon=10.0, delta=1e-6, rho=None, accountant="basic/1",
                                             adjacency="add_remove"), actor="test")

    def spec_text(self, text: str | bytes) -> Path:
        p = self.root / "spec.yaml"
        p.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
        return p

    def spec_doc(self, doc: dict) -> Path:
        return self.spec_text(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False))

    def run(self):
        return run_cli(["release", "run", str(self.root / "spec.yaml"), "--interval", INTERVAL, "--ledger", self.url,
                        "--key-file", str(self.key_file), "--no-gx-checks", "--publish", "--json"],
                       env={"DPOPS_STATE_DIR": str(self.root / "state")})

    def ledger_runs(self) -> list:
        from dpops.ledger import open_ledger

        with open_ledger(self.url) as led:
            assert led.verify().ok
            assert all(e.run_id is None for e in led.history()), "a refused run wrote to the ledger"
            return led.runs()

    def published(self) -> pa.Table | None:
        hits = list((self.root / "out" / "published").glob(f"*/{SLUG}/current/data.parquet"))
        return pq.read_table(hits[0]) if hits else None

    def internal(self) -> dict:
        hits = list((self.root / "state" / "runs").glob(f"*/{SLUG}/*.internal.json"))  # private run log
        return json.loads(hits[0].read_text()) if hits else {}


def _assert_refused(case: Case, r, code: int, fragment: str) -> None:
    assert not r.traceback, r.err[-3000:]
    assert r.rc == code, f"expected exit {code}, got {r.rc}: {r.err[-2000:]}"
    assert fragment.lower() in r.err.lower(), f"{fragment!r} not in: {r.err[-2000:]}"
    err = "".join(line for line in r.err.splitlines(keepends=True) if not line.startswith("dpops: stage: "))
    assert err.startswith("dpops: error: "), r.err[:300]  # after the stage lines (issue 12), one error line
    assert case.published() is None and not (case.root / "out" / "published").exists()
    # refused before reading data: no reservation, no charge, not even a released run
    from dpops.ledger import open_ledger

    with open_ledger(case.url) as led:
        assert not led.runs() and led.status(SCOPE).total == 0
    case.ledger_runs()


def _flat(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v))
        else:
            out[k] = v
    return out


def _assert_published(case: Case, r, *, partitions=None, dropped=(), spec: dict = BASE) -> pa.Table:
    assert not r.traceback and r.rc == 0, r.err[-3000:]
    assert r.json()["state"] == "published"
    table = case.published()
    assert table is not None
    for name in table.column_names:
        col = table.column(name)
        if pa.types.is_floating(col.type):
            vals = col.to_numpy(zero_copy_only=False)
            assert not np.isnan(vals).any(), f"NaN in {name}"
            assert np.isfinite(vals).all(), f"inf in {name}"
    want = partitions if partitions is not None else spec["partitions"]["public"]
    assert sorted(table.column("region").to_pylist()) == sorted(want)
    for m in spec["metrics"]:
        if m["type"] == "mean":  # clamp_means_to_bounds (post-processing of the noisy ratio)
            lo, hi = m["bounds"]
            assert all(lo <= x <= hi for x in table.column(f"mean_{m['column']}").to_pylist())
    counters = _flat(case.internal())
    for c in dropped:
        assert counters.get(c, 0) > 0, f"internal counter {c} is {counters.get(c)}: {counters}"
    from dpops.ledger import open_ledger

    with open_ledger(case.url) as led:
        assert led.verify().ok
        assert [x.state for x in led.runs()] == ["committed"]
    return table


# --------------------------------------------------------------------------- indexed cases


@pytest.mark.parametrize("entry", INDEX["specs"], ids=[Path(e["spec"]).stem for e in INDEX["specs"]])
def test_hostile_spec(tmp_path, key_file, entry):
    case = Case(tmp_path, key_file)
    shutil.copy(CORPUS / "inputs/single_row.csv", tmp_path / "data/2024-01-01.csv")
    case.spec_text((CORPUS / entry["spec"]).read_bytes())
    r = case.run()
    _assert_refused(case, r, entry["exit"], entry["error"])
    # `dpops spec check` says the same, with the same exit code
    chk = run_cli(["spec", "check", str(tmp_path / "spec.yaml")])
    assert chk.rc == entry["exit"] and not chk.traceback, chk.err[-2000:]
    assert not Path("/tmp/dpops-pwned").exists()


@pytest.mark.parametrize("entry", INDEX["inputs"], ids=[Path(e["input"]).stem for e in INDEX["inputs"]])
def test_hostile_input(tmp_path, key_file, entry):
    case = Case(tmp_path, key_file)
    shutil.copy(CORPUS / entry["input"], tmp_path / "data/2024-01-01.csv")
    spec = _merge(BASE, entry.get("patch", {}))
    case.spec_doc(spec)
    r = case.run()
    if "exit" in entry:
        _assert_refused(case, r, entry["exit"], entry["error"])
    else:
        _assert_published(case, r, partitions=entry.get("partitions"), dropped=entry.get("dropped", ()), spec=spec)


def test_index_lists_every_corpus_file():
    listed = {e["spec"] for e in INDEX["specs"]} | {e["input"] for e in INDEX["inputs"]}
    on_disk = {str(p.relative_to(CORPUS)) for p in CORPUS.glob("*/*") if p.is_file()}
    assert on_disk == listed, f"unindexed: {on_disk - listed}, missing: {listed - on_disk}"


# --------------------------------------------------------------------------- generated cases


def test_one_unit_with_a_million_rows_is_bounded(tmp_path, key_file):
    """One unit floods a partition with 10^6 rows of a huge value: it still counts at most L0*Linf
    rows. Other units: 60 users x <= 2 rows in north. Count noise is Laplace with b = L0*Linf/(eps/3)
    = 12, so a noisy north count above 1000 (true bounded count <= 122) has probability < 1e-30."""
    case = Case(tmp_path, key_file)
    n = 1_000_000
    rng = np.random.default_rng(5)
    users = np.concatenate([np.full(n, "whale", dtype=object), np.array([f"u{i}" for i in rng.integers(0, 60, 200)],
                                                                         dtype=object)])
    pq.write_table(pa.table({
        "user_id": pa.array(users, pa.string()),
        "region": pa.array(["north"] * (n + 200), pa.string()),
        "amount": pa.array(np.concatenate([np.full(n, 1e12), rng.uniform(0, 100, 200)])),
    }), tmp_path / "data/2024-01-01.parquet")
    spec = _merge(BASE, {"input": {"path": "data/{start:%Y-%m-%d}.parquet", "format": "parquet"}})
    case.spec_doc(spec)
    table = _assert_published(case, case.run(), spec=spec)
    north = dict(zip(table.column("region").to_pylist(), table.column("count").to_pylist()))["north"]
    assert north < 1000, f"the whale's 10^6 rows were not bounded: noisy count {north}"
    counters = _flat(case.internal())
    assert counters.get("rows_dropped_linf", 0) >= n - 2


def test_very_long_partition_keys(tmp_path, key_file):
    keys = ["k" * 10_000, "é" * 5_000, "x" * 9_999 + "🙂"]
    case = Case(tmp_path, key_file)
    lines = ["user_id,region,amount"] + [f"u{i},{keys[i % 3]},{i % 100}" for i in range(60)]
    (tmp_path / "data/2024-01-01.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    spec = _merge(BASE, {"partitions": {"columns": ["region"], "public": keys}})
    case.spec_doc(spec)
    _assert_published(case, case.run(), partitions=keys, spec=spec)


def test_oversized_spec_is_refused_unread(tmp_path, key_file):
    case = Case(tmp_path, key_file)
    shutil.copy(CORPUS / "inputs/single_row.csv", tmp_path / "data/2024-01-01.csv")
    case.spec_text((CORPUS / "base_spec.yaml").read_text() + "#" + "x" * (2 << 20) + "\n")
    _assert_refused(case, case.run(), 3, "limited to")


def test_parquet_with_a_wrong_column_type(tmp_path, key_file):
    case = Case(tmp_path, key_file)
    pq.write_table(pa.table({"user_id": ["u1", "u2"], "region": ["north", "south"], "amount": ["1.5", "oops"]}),
                   tmp_path / "data/2024-01-01.parquet")
    case.spec_doc(_merge(BASE, {"input": {"path": "data/{start:%Y-%m-%d}.parquet", "format": "parquet"}}))
    _assert_refused(case, case.run(), 4, "amount")


def test_missing_input_file(tmp_path, key_file):
    case = Case(tmp_path, key_file)
    case.spec_doc(BASE)
    _assert_refused(case, case.run(), 4, "does not exist")


def test_nan_never_reaches_an_aggregate_even_when_every_value_is_bad(tmp_path, key_file):
    """Every amount is NaN/inf/empty: all rows dropped, the public partitions still published (zeros +
    noise), and no NaN in the sums or means."""
    case = Case(tmp_path, key_file)
    bad = ["nan", "inf", "-inf", "", "NaN"]
    lines = ["user_id,region,amount"] + [f"u{i},{'north' if i % 2 else 'south'},{bad[i % 5]}" for i in range(50)]
    (tmp_path / "data/2024-01-01.csv").write_text("\n".join(lines) + "\n")
    case.spec_doc(BASE)
    table = _assert_published(case, case.run(), dropped=["dropped_bad_value"])
    assert all(math.isfinite(x) for x in table.column("sum_amount").to_pylist())


# --------------------------------------------------------------------------- hostile command lines

# name -> (argv after "dpops", with {spec} {key} {url} {root} placeholders; exit code; message fragment)
HOSTILE_ARGS = {
    "reversed_interval": ("release run {spec} --interval 2024-01-02/2024-01-01 --key-file {key} --ledger {url}", 3,
                          "must be before its end"),
    "garbage_interval": ("release run {spec} --interval yesterday --key-file {key} --ledger {url}", 3, "START/END"),
    "missing_key_file": ("release run {spec} --interval 2024-01-01/2024-01-02 --key-file {root}/nokey --ledger {url}",
                         3, "does not exist"),
    "short_key_file": ("release run {spec} --interval 2024-01-01/2024-01-02 --key-file {root}/short.key --ledger {url}",
                       3, "short.key' is not a dpops noise key file"),  # format first (issue 19 item 9), names the file
    "unknown_ledger_scheme": ("release run {spec} --interval 2024-01-01/2024-01-02 --key-file {key} --ledger mysql://x/y",
                              6, "unsupported ledger URL scheme"),
    "ledger_not_a_database": ("release run {spec} --interval 2024-01-01/2024-01-02 --key-file {key} "
                              "--ledger sqlite:///{root}/short.key", 6, "not a database"),
    "unreachable_postgres": ("release run {spec} --interval 2024-01-01/2024-01-02 --key-file {key} "
                             "--ledger postgresql://postgres@127.0.0.1:1/x", 6, "cannot connect"),
    "spec_missing": ("release run {root}/none.yaml --interval 2024-01-01/2024-01-02 --key-file {key} --ledger {url}", 3,
                     "cannot read the release spec"),
    "scope_not_in_ledger": ("release run {root}/c/other_scope.yaml --interval 2024-01-01/2024-01-02 --key-file {key} "
                            "--ledger {url}", 3, "is not in the ledger"),  # exit 3 as in spec check (issue 28 item 9)
    "recover_negative_age": ("ledger --ledger {url} recover --older-than -1", 3, "finite number >= 0"),
    "recover_nan_age": ("ledger --ledger {url} recover --older-than nan", 3, "finite number >= 0"),
    "scope_infinite_cap": ("ledger --ledger {url} scope create x --unit u --unit-column u --epsilon inf --delta 0 "
                           "--accountant rdp --adjacency add_remove", 3, "finite number > 0"),
    "scope_unknown_accountant": ("ledger --ledger {url} scope create x --unit u --unit-column u --epsilon 1 --delta 0 "
                                 "--accountant nope/9 --adjacency add_remove", 3, "unknown accountant"),
}


@pytest.mark.parametrize("name", list(HOSTILE_ARGS))
def test_hostile_command_line(tmp_path, key_file, name):
    """Bad arguments: a dpops exit code and a message naming the problem, no traceback, no run in the ledger."""
    case = Case(tmp_path / "c", key_file)
    shutil.copy(CORPUS / "inputs/single_row.csv", tmp_path / "c/data/2024-01-01.csv")
    spec = case.spec_doc(BASE)
    (tmp_path / "c/other_scope.yaml").write_text(yaml.safe_dump(_merge(BASE, {"budget": {"scope": "nope"}})))
    short = tmp_path / "short.key"
    short.write_bytes(b"abc")
    short.chmod(0o600)
    template, code, fragment = HOSTILE_ARGS[name]
    argv = [a.format(spec=spec, key=key_file, url=case.url, root=tmp_path) for a in template.split()]
    r = run_cli(argv)
    assert not r.traceback and r.rc == code, f"exit {r.rc}: {r.err[-2000:]}"
    assert fragment.lower() in r.err.lower(), r.err[-2000:]
    assert case.published() is None
    assert case.ledger_runs() == []

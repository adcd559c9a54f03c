"""The Airflow tests' own cost-saving helpers (tests/airflow_support.py) must not change what the tests run on.

- The stacks' metadata databases are copies of one migrated template (``metadata_db``): the copy must be what
  ``airflow db migrate`` makes for a stack, or every stack test would run on a database no deployment has.
- ``airflow_cli_batch`` runs setup commands in one interpreter: every command runs, in order, and the first that
  fails fails the batch and is named.
"""

from __future__ import annotations

import airflow_support  # noqa: F401  (environment before airflow)

import re
import secrets
import subprocess
from pathlib import Path

import pytest

from airflow_support import (airflow_cli, airflow_cli_batch, airflow_env, metadata_db, metadata_template_name,
                             pg_exec)


def _plain(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _schema(url: str) -> str:
    """``pg_dump --schema-only`` of the database, without the lines that belong to the dump itself (comments,
    ``set_config``, the random ``\\restrict`` token of pg_dump 15.14+)."""
    proc = subprocess.run(["pg_dump", "--schema-only", "--no-owner", "--no-privileges", _plain(url)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return "\n".join(line for line in proc.stdout.splitlines()
                     if not line.startswith(("--", "\\restrict", "\\unrestrict")) and not re.match(r"SELECT pg_catalog\.set_config", line))


def _contents(url: str) -> dict[str, list[tuple]]:
    """Every table's rows, sorted, without timestamp columns (the migration stamps its rows with its own time)."""
    tables = [r[0] for r in pg_exec(_plain(url), "SELECT tablename FROM pg_tables WHERE schemaname = 'public'",
                                    fetch=True)]
    out = {}
    for table in tables:
        cols = [r[0] for r in pg_exec(_plain(url), "SELECT column_name FROM information_schema.columns WHERE "
                                      "table_schema = 'public' AND table_name = %s AND data_type NOT LIKE "
                                      "'timestamp%%' ORDER BY ordinal_position", (table,), fetch=True)]
        select = ", ".join(f'"{c}"' for c in cols) or "1"
        out[table] = sorted(map(repr, pg_exec(_plain(url), f'SELECT {select} FROM "{table}"', fetch=True)))
    return out


def test_the_template_name_follows_the_settings_db_migrate_writes() -> None:
    base = airflow_env(Path("/h"), "", Path("/s"))
    name = metadata_template_name(base)
    assert re.fullmatch(r"dpops_af_template_[0-9a-f]{16}", name)
    # a stack's own settings that the migration does not write share the template ...
    assert metadata_template_name({**base, "AIRFLOW__CORE__PARALLELISM": "4", "AIRFLOW_HOME": "/x"}) == name
    # ... the ones it writes do not
    for key in airflow_support.MIGRATE_INPUTS:
        assert metadata_template_name({**base, key: "7"}) != name, key
    assert "AIRFLOW__CORE__DEFAULT_POOL_TASK_SLOT_COUNT" in airflow_support.MIGRATE_INPUTS


@pytest.mark.slow
@pytest.mark.postgres
def test_a_copy_is_what_db_migrate_makes_for_a_stack(tmp_path: Path, postgres_url: str) -> None:
    """A fresh ``airflow db migrate`` in a stack's environment against a copy of the template: the same schema
    and the same rows (the default pool, the log templates, Airflow's and the FAB provider's Alembic revisions)."""
    fresh = f"af_template_check_{secrets.token_hex(4)}"
    pg_exec(postgres_url, f'CREATE DATABASE "{fresh}"')
    try:
        fresh_url = postgres_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1) + f"/{fresh}"
        env = airflow_env(tmp_path, fresh_url, tmp_path, AIRFLOW__CORE__EXECUTOR="LocalExecutor",
                          AIRFLOW__CORE__PARALLELISM="4", AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="False")
        airflow_cli(env, "db", "migrate", timeout=300)
        with metadata_db(postgres_url, "af_template_copy") as copy_url:
            assert _schema(copy_url) == _schema(fresh_url)
            copy, made = _contents(copy_url), _contents(fresh_url)
            assert copy == made
            # what the migration writes besides the schema, and nothing else (no DAG, run or connection)
            assert {t for t, rows in copy.items() if rows} == {"alembic_version", "alembic_version_fab", "slot_pool",
                                                               "log_template"}, {t: r for t, r in copy.items() if r}
    finally:
        pg_exec(postgres_url, f'DROP DATABASE IF EXISTS "{fresh}" WITH (FORCE)')


@pytest.mark.slow
def test_a_batch_runs_every_command_and_stops_at_the_first_that_fails(tmp_path: Path) -> None:
    env = airflow_env(tmp_path, f"sqlite:///{tmp_path / 'airflow.db'}", tmp_path)
    # `--help` ends its command with exit 0: the batch goes on to the next
    out = airflow_cli_batch(env, [["version", "--help"], ["version"]]).stdout
    assert out.count("[airflow_cli_batch] airflow ") == 2 and "Usage: airflow version" in out
    import airflow

    assert airflow.__version__ in out.split("[airflow_cli_batch] airflow version\n", 1)[1]
    with pytest.raises(AssertionError) as err:
        airflow_cli_batch(env, [["version"], ["no-such-command"], ["version"]])
    msg = str(err.value)
    assert msg.startswith("[airflow_cli_batch] airflow no-such-command failed (exit 2)"), msg
    # the command after it never ran
    assert msg.count("[airflow_cli_batch] airflow version") == 1 and "[airflow_cli_batch] done" not in msg, msg

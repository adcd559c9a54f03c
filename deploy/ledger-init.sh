#!/bin/sh
# The compose `ledger-init` service, run as the ledger OWNER role (never as the app role):
#   1. create or migrate the ledger schema, grant the application role its rights and the reader role
#      (the api-server's Privacy budget page) SELECT only;
#   2. create the example release's budget scope. Idempotent against legitimate history: a restart is a
#      no-op, also after the runbook's `dpops ledger cap example --epsilon 14` (the scope exists as created
#      and only its cap changed through the ledger: the cap is left alone and the line says so). A scope
#      whose definition really differs is refused (exit 6), never changed: caps change with `dpops ledger cap`.
#      --time-column records which column's time puts a row in a period (issue 19): every release on the
#      scope must declare it as input.time_column. On a ledger whose `example` scope predates time rules,
#      this same command pins it (one `scope_time_pinned` entry), so an upgraded stack restarts cleanly.
# Operators create the scopes of their own releases the same way (docs/runbook.md).
set -eu
APP_ROLE="${DPOPS_LEDGER_APP_ROLE:-dpops_app}"
READER_ROLE="${DPOPS_LEDGER_READER_ROLE:-dpops_reader}"
dpops ledger init --app-role "$APP_ROLE" --reader-role "$READER_ROLE"
dpops ledger scope create example --unit "a synthetic user's events on one day" --unit-column user_id \
    --adjacency add_remove --time-column ts --epsilon 10 --delta 0 --accountant basic --actor ledger-init \
    --description "compose example release (deploy/specs/example_daily.yaml)"

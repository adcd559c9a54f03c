#!/bin/sh
# Runs once, on the ledger database's first start (postgres image /docker-entrypoint-initdb.d), as the superuser:
#   1. creates the ledger owner role, the application role and the reader role, and the ledger schema owned
#      by the owner (deploy/ledger-roles.sql);
#   2. installs the database's own cap check (`dpops ledger install-cap-check`, schema version 5): a PL/Python
#      function that runs dpops' cap rule on every reservation the application role writes, so that one written
#      around dpops is refused by the database. Only a superuser may create it (an untrusted language), which is
#      why it runs here and not in `ledger-init`. The image (deploy/ledger-db.Dockerfile) has PL/Python and
#      dpops under /opt/dpops-ledger, readable by the server and writable only by root.
# The `ledger-init` service then creates the schema's tables as the owner and grants the app role its rights
# and the reader SELECT only (`dpops ledger init` refuses to grant an app role before step 2 ran).
set -eu
OWNER_ROLE="${DPOPS_LEDGER_OWNER_ROLE:-dpops_ledger_owner}"
LEDGER_SCHEMA="${DPOPS_LEDGER_SCHEMA:-dpops}"
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
     -v owner_role="$OWNER_ROLE" -v ledger_schema="$LEDGER_SCHEMA" \
     -v owner_password_file=/run/secrets/ledger_owner_password \
     -v app_password_file=/run/secrets/ledger_app_password \
     -v reader_password_file=/run/secrets/ledger_reader_password \
     -f /opt/dpops/ledger-roles.sql
"${DPOPS_LEDGER_BIN:-/opt/dpops-ledger/bin}/dpops" ledger \
    --ledger "postgresql://$POSTGRES_USER@/$POSTGRES_DB?host=/var/run/postgresql&schema=$LEDGER_SCHEMA" \
    install-cap-check --owner-role "$OWNER_ROLE"

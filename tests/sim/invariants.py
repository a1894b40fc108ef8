"""What must hold once the simulated world is quiet, and the ledger that says what was written.

``check(world, feed)`` compares every device with every other and with the server's feed:

- the same sessions (id, title, message ids, deleted flag, lineage, head checkpoint, vector);
- the same transcript of every live session, every message id resolving to a message;
- the same checkpoints of every live session, the same event log per session (ids, canonical
  sequence numbers and hashes, in order), the same audit rows;
- every event chain verifies on every device, and every device's audit chain verifies on
  every device; every event a device holds is canonical (placed by the server, whether the
  device learned its place from a page or from its push's ack);
- a resume's fold of each session's log (read on from the fold an earlier resume kept, when
  the log still begins with that one) is the whole log's fold;
- nothing pending, nothing dead-lettered;
- every artifact reads the same everywhere and holds every piece of text appended to it;
- every conflict fork on the server is announced by a ``sync.conflict`` event in some log;
- every session a ``sync.delete.kept`` event names (a resolved version the server kept beside
  a delete) is held, on every device and the server;
- every user message a device wrote is in some live session on every device and on the
  server, unless a rollback or a delete touched its session's family (the session and every
  session forked from it or it from, transitively) after the message was written, or a delete
  of its own session happened at any time: delete wins, so what another device wrote to a
  session before it learned of the delete goes with the session.

Each problem is one string ``"<category>: <detail>"``; the categories let the shrinker keep a
failure of the same kind.
"""

from __future__ import annotations

import contextlib
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from pleach_client.hydration import hydrate, load_hydration
from shared.compact import KINDS
from shared.errors import NotFound
from shared.records import AuditRow, Checkpoint, Event, Message, Session

if TYPE_CHECKING:
    from .harness import World

MAX_PROBLEMS = 25


@dataclass(frozen=True)
class Written:
    op: int
    message_id: str
    session_id: str
    text: str


@dataclass
class Ledger:
    """What the scheduler caused: user messages written, destructive ops, artifact text."""

    written: list[Written] = field(default_factory=list)
    destructive_ops: list[tuple[int, str, str]] = field(default_factory=list)
    artifact_tokens: dict[str, list[str]] = field(default_factory=dict)
    artifact_sessions: dict[str, str] = field(default_factory=dict)

    def wrote(self, op: int, message_id: str, session_id: str, text: str) -> None:
        self.written.append(Written(op, message_id, session_id, text))

    def destructive(self, op: int, kind: str, session_id: str) -> None:
        self.destructive_ops.append((op, kind, session_id))

    def deleted(self) -> set[str]:
        """Sessions some device deleted (delete wins over concurrent writes)."""
        return {sid for _, kind, sid in self.destructive_ops if kind == "delete"}


SESSION_FIELDS = (
    "title",
    "deleted",
    "forked_from",
    "conflict_id",
    "conflict_loser_side",
    "head_checkpoint_id",
    "vv",
    "updated_at",
)


def session_key(s: Session) -> dict[str, Any]:
    key = {f: getattr(s, f, None) for f in SESSION_FIELDS}
    key["message_ids"] = list(s.state.message_ids)
    key["artifacts"] = list(s.state.artifacts)
    return key


@dataclass
class View:
    """One holder's data (a device, or the server's feed), in comparable form."""

    name: str
    sessions: dict[str, dict[str, Any]] = field(default_factory=dict)
    transcripts: dict[str, list[tuple[str, str, str]]] = field(default_factory=dict)
    checkpoints: dict[str, list[str]] = field(default_factory=dict)
    events: dict[str, list[tuple[str, int, str]]] = field(default_factory=dict)
    audit: set[str] = field(default_factory=set)
    messages: set[str] = field(default_factory=set)
    announced: set[str] = field(default_factory=set)  # conflict ids of sync.conflict events
    kept: set[str] = field(default_factory=set)  # sessions sync.delete.kept events name

    def live(self) -> set[str]:
        return {sid for sid, s in self.sessions.items() if not s["deleted"]}


def _announced(events: list[Event]) -> set[str]:
    return {str(e.payload.get("conflict_id")) for e in events if e.type == "sync.conflict"}


def _kept(events: list[Event]) -> set[str]:
    return {str(e.payload.get("fork_session_id")) for e in events if e.type == "sync.delete.kept"}


def _message_key(m: Message) -> tuple[str, str, str]:
    return (m.id, m.role, msgspec.json.encode(m.content).decode())


def _chain_forensics(rows: list[Any], most: int = 8) -> str:
    """One chain's first rows as ``#seq id prev>hash`` (short prefixes): what a failing
    chain holds, for the report."""
    rows = sorted(rows, key=lambda r: r.sequence_number)[:most]
    return ", ".join(
        f"#{r.sequence_number} {r.id[-6:]} {r.prev_hash[:6] or '-'}>{r.row_hash[:6]}" for r in rows
    )


async def device_view(world: World, index: int, problems: list[str]) -> View:
    dev = world.devices[index]
    rt = dev.rt
    assert rt is not None
    view = View(dev.name)
    first_id = getattr(dev, "first_client_id", None)  # campaigns' devices do not say
    stats = getattr(world, "stats", {})
    if (
        first_id is not None
        and rt.client_id != first_id
        and not (stats.get("restored") or stats.get("cloned"))
    ):
        # A new id is taken only when another copy of the file wrote under this one: with no
        # file restored or copied, a re-key is a false alarm (and moves audit rows).
        problems.append(
            f"false-rekey: {dev.name} now syncs as {rt.client_id} with no file restored or copied"
        )
    status = await rt.sync.status()
    if status.pending:
        problems.append(f"pending: {dev.name} still has {status.pending} outbox rows")
    if status.dead_letters:
        dead = await rt.sync.dead_letters()
        problems.append(
            f"dead-letter: {dev.name} dead-lettered "
            + ", ".join(f"{type(d.record).__name__} {d.code} {d.message}" for d in dead[:3])
        )
    for s in await rt.sessions.list(include_deleted=True):
        view.sessions[s.id] = session_key(s)
    for sid, key in view.sessions.items():
        events = [e async for e in rt.events.iterate(sid)]
        view.events[sid] = [(e.id, e.sequence_number, e.row_hash) for e in events]
        provisional = [e for e in events if not e.canonical]
        if provisional:
            problems.append(
                f"event-provisional: {dev.name} session {sid} holds {len(provisional)} event(s) "
                f"the server placed but it never marked canonical (first #"
                f"{provisional[0].sequence_number})"
            )
        view.announced.update(_announced(events))
        view.kept.update(_kept(events))
        # A resume's fold, read on from what an earlier resume kept (or whole), is the whole
        # log's fold (the runtime keeps it between resumes: ``pleach_client.hydration``).
        state, step = await load_hydration(rt.store, sid)
        if state != hydrate(events):
            problems.append(
                f"hydration-differs: {dev.name} session {sid}: the resume's fold ({step}) is "
                "not the whole log's"
            )
        report = await rt.events.verify_chain(sid)
        if not report.ok:
            problems.append(
                f"event-chain: {dev.name} session {sid} fails at {report.first_bad_index}: "
                f"{report.reason}"
            )
        if key["deleted"]:
            continue
        transcript = await rt.sessions.messages(sid)
        view.transcripts[sid] = [_message_key(m) for m in transcript]
        view.messages.update(m.id for m in transcript)
        if [m.id for m in transcript] != key["message_ids"]:
            missing = set(key["message_ids"]) - {m.id for m in transcript}
            problems.append(
                f"missing-message-record: {dev.name} session {sid} refers to "
                f"{len(missing)} message(s) it does not hold"
            )
        view.checkpoints[sid] = sorted(c.id for c in await rt.checkpoints.list(sid))
    rows = await rt.audit.rows()
    view.audit = {r.id for r in rows}
    chains = {r.client_id for r in rows} | {
        d.rt.client_id for d in world.devices if d.rt is not None
    }
    for client_id in sorted(chains):
        report = await rt.audit.verify_chain(client_id)
        if not report.ok:
            problems.append(
                f"audit-chain: {dev.name} chain of {client_id} fails at "
                f"{report.first_bad_index}: {report.reason}; rows here: "
                + _chain_forensics([r for r in rows if r.client_id == client_id])
            )
    deleted = world.ledger.deleted()
    for artifact_id, tokens in world.ledger.artifact_tokens.items():
        if world.ledger.artifact_sessions.get(artifact_id) in deleted:
            continue  # its session was deleted: the artifact went with it
        try:
            text = await rt.artifacts.text(artifact_id)
        except NotFound:
            problems.append(f"artifact-missing: {dev.name} has no artifact {artifact_id}")
            continue
        lost = [t for t in tokens if t not in text]
        if lost:
            problems.append(f"artifact-text: {dev.name} artifact {artifact_id} lost {lost}")
        view.transcripts[f"artifact:{artifact_id}"] = [("text", "", text)]
    return view


def server_view(feed: list[Any]) -> View:
    view = View("server")
    sessions: dict[str, Session] = {}
    checkpoints: dict[str, list[Checkpoint]] = {}
    events: dict[str, list[Event]] = {}
    messages: dict[str, Message] = {}
    for change in feed:
        record = change.record
        match record:
            case Session():
                sessions[record.id] = record  # the feed only ever moves a session forward
            case Checkpoint():
                checkpoints.setdefault(record.session_id, []).append(record)
            case Event():
                events.setdefault(record.session_id, []).append(record)
            case AuditRow():
                view.audit.add(record.id)
            case Message():
                messages[record.id] = record
    for sid, s in sessions.items():
        view.sessions[sid] = session_key(s)
        if not s.deleted:
            view.transcripts[sid] = [
                _message_key(messages[m]) for m in s.state.message_ids if m in messages
            ]
            view.messages.update(m for m in s.state.message_ids if m in messages)
            view.checkpoints[sid] = sorted(c.id for c in checkpoints.get(sid, []))
    for sid, evs in events.items():
        view.announced.update(_announced(evs))
        view.kept.update(_kept(evs))
        view.events[sid] = [
            (e.id, e.sequence_number, e.row_hash)
            for e in sorted(evs, key=lambda e: e.sequence_number)
        ]
    return view


def _diff(a: View, b: View, problems: list[str], *, server: bool) -> None:
    if set(a.sessions) != set(b.sessions):
        only_a = sorted(set(a.sessions) - set(b.sessions))
        only_b = sorted(set(b.sessions) - set(a.sessions))
        problems.append(f"sessions-differ: only on {a.name}: {only_a}; only on {b.name}: {only_b}")
    for sid in sorted(set(a.sessions) & set(b.sessions)):
        x, y = a.sessions[sid], b.sessions[sid]
        if x != y:
            fields = sorted(k for k in x if x[k] != y.get(k))
            problems.append(
                f"session-differs: {sid} on {a.name} vs {b.name}: "
                + "; ".join(f"{f}={x[f]!r} vs {y[f]!r}" for f in fields)
            )
    for name, left, right in (
        ("transcript-differs", a.transcripts, b.transcripts),
        ("checkpoints-differ", a.checkpoints, b.checkpoints),
        ("events-differ", a.events, b.events),
    ):
        for key in sorted(set(left) | set(right)):
            if key.startswith("artifact:") and server:
                continue
            x, y = left.get(key) or [], right.get(key) or []
            if x != y:
                only_x = [v for v in x if v not in y][:3]
                only_y = [v for v in y if v not in x][:3]
                problems.append(
                    f"{name}: {key} on {a.name} ({len(x)}) vs {b.name} ({len(y)}); "
                    f"only on {a.name}: {only_x}; only on {b.name}: {only_y}"
                    + ("" if only_x or only_y else "; same items, another order")
                )
    if a.audit != b.audit:
        problems.append(
            f"audit-differs: {len(a.audit - b.audit)} rows only on {a.name}, "
            f"{len(b.audit - a.audit)} only on {b.name}"
        )


def _kept_missing(view: View, problems: list[str]) -> None:
    """A session a ``sync.delete.kept`` event names (the server kept a resolved version
    beside a delete) must be there: live, or a tombstone of a later delete."""
    for sid in sorted(view.kept - set(view.sessions)):
        problems.append(
            f"kept-missing: {view.name}'s log says a resolved version was kept as {sid}, "
            "which it does not hold"
        )
        return


def _unannounced(view: View, problems: list[str]) -> None:
    """Every conflict fork must be announced by a ``sync.conflict`` event in the log."""
    for sid, s in sorted(view.sessions.items()):
        if s["conflict_id"] and s["conflict_id"] not in view.announced:
            problems.append(
                f"conflict-unannounced: {view.name} holds fork {sid} of conflict "
                f"{s['conflict_id']} but no sync.conflict event names it"
            )
            return


def families(views: list[View]) -> dict[str, str]:
    """Session id -> a representative of its family (linked by ``forked_from``)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for view in views:
        for sid, s in view.sessions.items():
            find(sid)
            if s["forked_from"]:
                parent[find(sid)] = find(s["forked_from"])
    return {sid: find(sid) for sid in list(parent)}


def _holds(view: View, session_id: str, w: Written) -> bool:
    for message_id, role, content in view.transcripts.get(session_id, []):
        if message_id == w.message_id:
            return True
        if role == "user" and any(
            block.get("text") == w.text for block in msgspec.json.decode(content)
        ):
            return True
    return False


def _lost_messages(world: World, views: list[View], problems: list[str]) -> None:
    family = families(views)
    touched: list[tuple[int, str]] = [
        (op, family.get(sid, sid)) for op, _, sid in world.ledger.destructive_ops
    ]
    deleted = world.ledger.deleted()
    for w in world.ledger.written:
        fam = family.get(w.session_id, w.session_id)
        excused = w.session_id in deleted or any(op > w.op and f == fam for op, f in touched)
        if excused:
            continue
        for view in views:
            # The message itself, or a copy of it: a fork and a conflict resolution copy what
            # they take under new ids (same role and text; every user text is unique).
            holders = [sid for sid in view.live() if _holds(view, sid, w)]
            if not holders:
                where = {
                    v.name: sorted(
                        sid for sid, s in v.sessions.items() if w.message_id in s["message_ids"]
                    )
                    for v in views
                }
                problems.append(
                    f"lost-user-message: {w.text!r} ({w.message_id}, op {w.op}, session "
                    f"{w.session_id}) is in no live session on {view.name}; "
                    f"sessions holding it anywhere (live or deleted): {where}"
                )
                break


def _id_lists_disagreed(dev: Any) -> bool:
    """Whether a runtime of ``dev`` saw its protocol 7 id lists disagree with the server's
    (the simulation's devices remember it across reopens; another harness's device is asked
    of the runtime it holds)."""
    note = getattr(dev, "note_id_lists", None)
    if note is not None:
        note()
        return bool(dev.id_lists_disagreed)
    facet = getattr(dev.rt, "_sync", None)
    return bool(facet is not None and facet._id_refs_failed)


async def check(world: World, feed: list[Any]) -> list[str]:
    problems: list[str] = []
    views = [await device_view(world, i, problems) for i in range(len(world.devices))]
    server = server_view(feed)
    for view in views[1:]:
        _diff(views[0], view, problems, server=False)
    _diff(views[0], server, problems, server=True)
    _lost_messages(world, [*views, server], problems)
    for view in [*views, server]:
        _kept_missing(view, problems)
    _unannounced(server, problems)
    for dev in world.devices:
        if _id_lists_disagreed(dev):
            problems.append(
                f"id-lists-disagreed: {dev.name}'s protocol 7 id lists disagreed with the "
                "server's (a 3004 ended a connection; it then sent rows whole)"
            )
    if len(problems) > MAX_PROBLEMS:
        problems = [*problems[:MAX_PROBLEMS], f"more: {len(problems) - MAX_PROBLEMS} more"]
    return problems


def server_file_problems(path: Path) -> list[str]:
    """What a SQLite server file breaks of its own layout (schema 11; messages apart since
    14): every feed entry of a record or an event has that row at the rowid of its cursor,
    in the table of its kind, and every such row at a positive rowid has its entry there (a
    delete that left an entry behind would make every later pull of that tenant fail; one
    that left a row would keep it forever). An entry that names no id (schema 16) has its
    row there; one that names an id, that row with that id. Every event's and record's
    session number names a session of the row's own tenant (schema 19 and 20), and every
    audit place an audit row of its chain's tenant (schema 21)."""
    problems: list[str] = []
    session = KINDS.index("Session")
    event = KINDS.index("Event")
    message = KINDS.index("Message")
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        orphans = conn.execute(
            "SELECT f.cursor, f.kind FROM feed AS f WHERE f.kind <> ?1 AND NOT EXISTS ("
            "SELECT 1 FROM records AS r WHERE f.kind <> ?3 AND r.rowid = f.cursor "
            "AND r.tid = f.tid AND r.kind = f.kind AND (f.record_id IS NULL OR r.id = f.record_id)) "
            "AND NOT EXISTS ("
            "SELECT 1 FROM messages AS r WHERE f.kind = ?3 AND r.rowid = f.cursor "
            "AND r.tid = f.tid AND r.kind = f.kind AND (f.record_id IS NULL OR r.id = f.record_id)) "
            "AND NOT EXISTS ("
            "SELECT 1 FROM events AS e WHERE f.kind = ?2 AND e.rowid = f.cursor "
            "AND e.tid = f.tid AND (f.record_id IS NULL OR e.id = f.record_id)) LIMIT 5",
            (session, event, message),
        ).fetchall()
        problems += [
            f"feed-orphan: entry {c} ({KINDS[k]}) has no row at its cursor" for c, k in orphans
        ]
        misfiled = conn.execute(
            "SELECT rowid, 'records' FROM records WHERE kind = ?1 "
            "UNION ALL SELECT rowid, 'messages' FROM messages WHERE kind <> ?1 LIMIT 5",
            (message,),
        ).fetchall()
        problems += [f"misfiled: {t} row {r} is of the other table's kind" for r, t in misfiled]
        # Every event's chain and every record's session number (schema 19, 20) is a row of
        # ``chains`` of the row's own tenant: a body read back whole names that session.
        for table, number in (("events", "chain"), ("records", "session"), ("messages", "session")):
            astray = conn.execute(
                f"SELECT rowid FROM {table} AS r WHERE r.{number} IS NOT NULL AND NOT EXISTS ("
                f"SELECT 1 FROM chains AS c WHERE c.n = r.{number} AND c.tid = r.tid) LIMIT 5"
            ).fetchall()
            problems += [
                f"session-astray: {table} row {r} names no session of its tenant" for (r,) in astray
            ]
        # Every audit place (schema 21) names an audit row of its chain's tenant.
        astray = conn.execute(
            "SELECT p.chain, p.sequence_number FROM audit_places AS p WHERE NOT EXISTS ("
            "SELECT 1 FROM audit_chains AS c JOIN records AS r ON r.tid = c.tid "
            "WHERE c.n = p.chain AND r.rowid = p.row AND r.kind = ?) LIMIT 5",
            (KINDS.index("AuditRow"),),
        ).fetchall()
        problems += [
            f"place-astray: place {n} of audit chain {c} names no audit row of its tenant"
            for c, n in astray
        ]
        for table, kind in (("records", "r.kind"), ("messages", message), ("events", event)):
            unfed = conn.execute(
                f"SELECT rowid FROM {table} AS r WHERE rowid > 0 AND NOT EXISTS ("
                "SELECT 1 FROM feed AS f WHERE f.cursor = r.rowid AND f.tid = r.tid "
                f"AND f.kind = {kind} AND (f.record_id IS NULL OR f.record_id = r.id)) LIMIT 5"
            ).fetchall()
            problems += [f"row-unfed: {table} row {r} has no feed entry at it" for (r,) in unfed]
    return problems


async def postgres_layout_problems(store: Any) -> list[str]:
    """The same of a PostgreSQL store's schema (version 18): the feed holds sessions' entries
    alone, each with its session's row (a record and an event are their own entries, at the
    cursor each keeps), no cursor of a tenant is in two places, and a row names the stamp
    node of its device exactly where its body left it out (forms 1, 2 and 17), a node
    ``nodes`` keeps, and keeps a row hash in its column exactly where its body does not end
    with it; a row's chain is a session of its tenant, and an audit chain's last place an
    audit row its tenant holds."""
    s, session = store.schema, KINDS.index("Session")
    async with store._pool.acquire() as conn:
        astray = await conn.fetch(
            f"SELECT f.cursor, f.kind FROM {s}.feed AS f WHERE f.kind <> $1 LIMIT 5", session
        )
        problems = [f"feed-kind: entry {c} ({KINDS[k]}) is in the feed" for c, k in astray]
        orphans = await conn.fetch(
            f"SELECT f.cursor FROM {s}.feed AS f WHERE NOT EXISTS (SELECT 1 FROM {s}.sessions "
            "AS x WHERE x.tid = f.tid AND x.id = f.record_id) LIMIT 5"
        )
        problems += [f"feed-orphan: entry {c} has no session row" for (c,) in orphans]
        twice = await conn.fetch(
            f"SELECT tid, cursor FROM (SELECT tid, cursor FROM {s}.feed UNION ALL "
            f"SELECT tid, cursor FROM {s}.records WHERE cursor IS NOT NULL UNION ALL "
            f"SELECT tid, cursor FROM {s}.events WHERE cursor IS NOT NULL) AS u "
            "GROUP BY tid, cursor HAVING count(*) > 1 LIMIT 5"
        )
        problems += [f"cursor-twice: tenant {t} has cursor {c} twice" for t, c in twice]
        for table in ("records", "events"):
            unnamed = await conn.fetch(
                f"SELECT r.cursor, r.device FROM {s}.{table} AS r WHERE (substr(r.body, 1, 2) "
                "IN ('\\xc101'::bytea, '\\xc102'::bytea, '\\xc111'::bytea)) IS DISTINCT FROM "
                f"(r.device IS NOT NULL AND EXISTS (SELECT 1 FROM {s}.nodes AS n "
                "WHERE n.n = r.device)) LIMIT 5"
            )
            problems += [
                f"node-unnamed: {table} row at {c} names node {d} where its body's form is "
                "another's"
                for c, d in unnamed
            ]
        hashed = await conn.fetch(
            f"SELECT e.cursor FROM {s}.events AS e WHERE (e.row_hash IS NULL) IS DISTINCT FROM "
            f"({s}.pleach_digest(e.body) IS NOT NULL) LIMIT 5"
        )
        problems += [
            f"hash-unkept: event at {c} keeps its row hash twice or not at all" for (c,) in hashed
        ]
        # Every event's and record's chain (version 18) is a row of ``chains`` of the row's
        # own tenant: a body read back whole names that session.
        for table in ("records", "events"):
            astray = await conn.fetch(
                f"SELECT r.cursor FROM {s}.{table} AS r WHERE r.chain IS NOT NULL AND NOT "
                f"EXISTS (SELECT 1 FROM {s}.chains AS c WHERE c.n = r.chain AND c.tid = r.tid) "
                "LIMIT 5"
            )
            problems += [
                f"session-astray: {table} row at {c} names no session of its tenant"
                for (c,) in astray
            ]
        # Every audit chain's last place (version 18) is an audit row its tenant holds.
        tails = await conn.fetch(
            f"SELECT t.client_id, t.sequence_number FROM {s}.audit_tails AS t WHERE NOT EXISTS ("
            f"SELECT 1 FROM {s}.records AS r WHERE r.tid = t.tid AND r.id = t.id "
            "AND r.kind = $1) LIMIT 5",
            KINDS.index("AuditRow"),
        )
        problems += [
            f"tail-astray: the last place ({n}) of audit chain {c} names no audit row"
            for c, n in tails
        ]
    return problems


__all__ = [
    "Ledger",
    "View",
    "Written",
    "check",
    "device_view",
    "families",
    "postgres_layout_problems",
    "server_file_problems",
    "server_view",
]

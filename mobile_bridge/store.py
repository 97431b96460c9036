"""The bridge's state in SQLite: devices (hashed tokens), enrolment codes, tasks and their updates.

A task of a secure round carries its SecAgg+ stage (``secagg``, JSON) and its update the device's
answer to that stage; they are columns added to an older state file when the bridge opens it.

Every change is one transaction in a WAL-mode database with ``synchronous=FULL``, so a bridge
killed with SIGKILL and started again knows every device, every task it handed out and every
update it accepted. Tokens and enrolment codes are stored as sha256 digests only.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import BridgeError

__all__ = ["Store", "Task", "Update", "digest"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS devices (name TEXT PRIMARY KEY, token_sha256 TEXT UNIQUE NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS codes (code_sha256 TEXT PRIMARY KEY, used_by TEXT, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS tasks (
    task_id TEXT PRIMARY KEY, device TEXT NOT NULL, round INTEGER NOT NULL, weights BLOB NOT NULL,
    config TEXT NOT NULL, deadline REAL NOT NULL, secagg TEXT);
CREATE INDEX IF NOT EXISTS tasks_by_device ON tasks (device);
CREATE TABLE IF NOT EXISTS updates (
    task_id TEXT PRIMARY KEY REFERENCES tasks (task_id) ON DELETE CASCADE, weights BLOB NOT NULL,
    num_examples INTEGER NOT NULL, metrics TEXT NOT NULL, bundle_sha256 TEXT NOT NULL, received REAL NOT NULL,
    secagg TEXT);
"""
_ADDED = {"tasks": "secagg", "updates": "secagg"}
"""Columns newer than the first state files: added (NULL) when an older file is opened."""


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class Task:
    task_id: str
    device: str
    round: int
    weights: bytes
    config: dict[str, Any]
    deadline: float
    secagg: dict[str, Any] | None = None
    """The SecAgg+ stage this task asks the device to answer (None: a plain training task)."""


@dataclass(frozen=True)
class Update:
    weights: bytes
    num_examples: int
    metrics: dict[str, float]
    bundle_sha256: str
    secagg: dict[str, Any] | None = None
    """The device's answer to a key stage of a secure round (``weights`` is then empty)."""


_TABLES = {"devices", "codes", "tasks", "updates"}


def _check_state(db: sqlite3.Connection, path: Path) -> None:
    """An existing state file must be a sound SQLite database holding the bridge's tables."""
    if path.stat().st_size == 0:
        raise BridgeError("the file is empty")
    verdict = db.execute("PRAGMA quick_check").fetchone()
    if verdict is None or verdict[0] != "ok":
        raise BridgeError(f"integrity check: {verdict[0] if verdict else 'no answer'}")
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not _TABLES <= tables:
        raise BridgeError(f"missing tables {sorted(_TABLES - tables)}")


class Store:
    """One SQLite file; methods are transactions (a lock serializes the bridge's threads)."""

    def __init__(self, path: Path) -> None:
        """Open (or create) the state file; one that exists but is not a whole bridge database is
        refused with a BridgeError, never replaced: it holds every device's enrolment."""
        self.path = path
        existed = path.exists()
        if existed and not path.is_file():
            raise BridgeError(f"bridge state {path} is not a file (a directory?); name the state file with --state.")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        except (OSError, sqlite3.Error) as exc:
            raise BridgeError(f"cannot open bridge state {path} ({getattr(exc, 'strerror', None) or exc}); "
                              "choose a writable --state.") from None  # fmt: skip
        try:
            if existed:
                _check_state(self._db, path)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(_SCHEMA)
            for table, column in _ADDED.items():
                if column not in {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} TEXT")
        except (sqlite3.DatabaseError, BridgeError) as exc:
            self._db.close()
            reason = str(exc) if isinstance(exc, BridgeError) else f"SQLite: {exc}"
            raise BridgeError(
                f"bridge state {path} is damaged ({reason}); it was left as it is. Restore it from a copy, or "
                "move it away to start with no devices (every device must then register again)."
            ) from None
        self._lock = threading.Lock()

    def _write(self, sql: str, args: tuple[Any, ...]) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    def _one(self, sql: str, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    # -- devices and enrolment -------------------------------------------------------------------
    def device_of(self, token: str) -> str | None:
        """The device a bearer token belongs to (an indexed lookup of the token's digest)."""
        row = self._one("SELECT name FROM devices WHERE token_sha256 = ?", (digest(token),))
        return None if row is None else str(row[0])

    def add_codes(self, codes: list[str]) -> None:
        with self._lock:
            self._db.executemany("INSERT INTO codes VALUES (?, NULL, ?)", [(digest(c), time.time()) for c in codes])

    def enrol(self, name: str, token: str, code: str | None) -> str | None:
        """Add a device, spending ``code`` (None: enrolled by the bridge's secret) in the same transaction;
        returns why not ("code" or "name"), and a refused registration spends nothing."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if self._db.execute("SELECT 1 FROM devices WHERE name = ?", (name,)).fetchone() is not None:
                    self._db.execute("ROLLBACK")
                    return "name"
                if (
                    code is not None
                    and self._db.execute(
                        "UPDATE codes SET used_by = ? WHERE code_sha256 = ? AND used_by IS NULL", (name, digest(code))
                    ).rowcount
                    != 1
                ):
                    self._db.execute("ROLLBACK")
                    return "code"
                self._db.execute("INSERT INTO devices VALUES (?, ?, ?)", (name, digest(token), time.time()))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return None

    def has_codes(self) -> bool:
        return self._one("SELECT 1 FROM codes WHERE used_by IS NULL LIMIT 1", ()) is not None

    # -- tasks and updates -----------------------------------------------------------------------
    def put_task(self, task: Task) -> None:
        """The device's new task replaces its old ones (a device works on one round at a time)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM tasks WHERE device = ?", (task.device,))
                self._db.execute(
                    f"INSERT INTO tasks ({_TASK}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (task.task_id, task.device, task.round, task.weights, json.dumps(task.config), task.deadline,
                     _json(task.secagg)),
                )  # fmt: skip
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def task(self, task_id: str) -> Task | None:
        return _task(self._one(f"SELECT {_TASK} FROM tasks WHERE task_id = ?", (task_id,)))

    def open_task(self, device: str, now: float) -> Task | None:
        """The device's task that still waits for an update and whose deadline has not passed."""
        columns = ", ".join(f"t.{c}" for c in _TASK.split(", "))
        return _task(self._one(
            f"SELECT {columns} FROM tasks t LEFT JOIN updates u USING (task_id) "
            "WHERE t.device = ? AND u.task_id IS NULL AND t.deadline > ?",
            (device, now),
        ))  # fmt: skip

    def put_update(self, task_id: str, update: Update) -> bool:
        """False when the task has an update already (replay)."""
        try:
            self._write(
                "INSERT INTO updates (task_id, weights, num_examples, metrics, bundle_sha256, received, secagg) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (task_id, update.weights, update.num_examples, json.dumps(update.metrics), update.bundle_sha256,
                 time.time(), _json(update.secagg)),
            )  # fmt: skip
        except sqlite3.IntegrityError:
            return False
        return True

    def update(self, task_id: str) -> Update | None:
        row = self._one("SELECT weights, num_examples, metrics, bundle_sha256, secagg FROM updates WHERE task_id = ?",
                        (task_id,))  # fmt: skip
        return None if row is None else Update(row[0], row[1], json.loads(row[2]), row[3], _loads(row[4]))

    def close(self) -> None:
        with self._lock:
            self._db.close()


_TASK = "task_id, device, round, weights, config, deadline, secagg"


def _json(value: dict[str, Any] | None) -> str | None:
    return None if value is None else json.dumps(value)


def _loads(text: str | None) -> dict[str, Any] | None:
    return None if text is None else json.loads(text)


def _task(row: tuple[Any, ...] | None) -> Task | None:
    return None if row is None else Task(row[0], row[1], row[2], row[3], json.loads(row[4]), row[5], _loads(row[6]))

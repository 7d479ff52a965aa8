"""doit's sqlite3 dependency file, committed as each task finishes instead of once at exit."""

from __future__ import annotations

from typing import Any

from doit.dependency import SqliteDB


class WriteThroughDB(SqliteDB):
    """Loses at most the task in flight to a SIGKILL (doit's own sqlite3 loses the whole invocation)."""

    desc = "sqlite3, committed after every task (tether)"

    def __init__(self, name: str, codec: Any, *, module_name: Any = None) -> None:
        super().__init__(name, codec, module_name=module_name)
        self._conn.execute("pragma journal_mode=wal")  # cheap commits, readers never blocked

    def set(self, task_id: str, dependency: str, value: Any) -> None:
        super().set(task_id, dependency, value)
        self._conn.execute("insert or replace into doit values (?,?)",
                           (task_id, self.codec.encode(self._cache[task_id])))
        self._conn.commit()
        self._dirty.discard(task_id)

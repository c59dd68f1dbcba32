"""Bounded in-memory memos: every table on the call path shares one limit and evicts together.

Why: a process that sees many distinct shapes (a serving framework with dynamic batch sizes, a
detector with per-image sizes) would otherwise keep every decision, validated problem, plan and
built kernel it ever made; built OpenCL programs are by far the largest (see docs/design.md,
"Memory").  So each memo entry is *filed under an owner* -- the ``Problem`` it was made for, or
for builds the program it holds -- and ``MEMOS`` keeps one least-recently-used order of owners
for all tables.  When more than ``limit()`` owners are held, or any one table holds more than
``limit()`` entries, the least recently used owner goes, and with it its entries in *every*
table: a problem's decision, its validated forced choices, its built kernel and the plans that
launch that kernel leave together, so no table keeps alive what another dropped.

How a module plugs in (``dispatch`` for its decisions and launches, ``ops`` for validated
problems, ``backends.opencl`` for programs and kernels, ``torch_cuda`` for its plans, and any
later per-call table)::

    _PLANS = memo.table("my_module.plans")       # once, at import
    plan = _PLANS.get(key)                       # a hit also marks the entry as recently used
    if plan is None:
        plan = _PLANS.put(problem, key, make_plan())   # filed under the problem it was made for

An owner is as recent as its most recently used entry, so a call needs to mark only one entry of
its problem: ``get`` marks, ``peek`` does not and is a plain dictionary lookup (``dispatch.choose``
marks the decision; ``prepare`` and ``ops`` peek).  A table whose hits skip ``dispatch.choose``
(a per-call plan) uses ``get``.

File an entry under the owner whose eviction must take it along: the ``Problem`` for anything
derived from one (so it leaves with that problem's built kernel), or the object it holds.  A
table that also has to be emptied by ``dispatch.forget`` registers with
``dispatch.register_dependent_memo``.

Thread safety: ``get`` and ``peek`` take no lock (a dictionary lookup, and for ``get`` a store
of the entry's recency stamp, each atomic under the GIL: they are on every call's path); ``put``,
eviction and ``clear`` hold one lock, so the tables and the owner index never disagree.  An
owner's recency is its most recently used entry's, worked out when one must be evicted.  Two
threads that miss the same key at once both compute it and the second ``put`` wins, which is
harmless for memos.  After ``os.fork`` the child starts with every table empty and a fresh lock
(entries may hold objects of the parent's OpenCL or CUDA runtime, and another thread of the parent
may have held the lock when it forked); the entries it forgets are kept alive, never released
(``keep_alive``).

The limit is ``POOL_TUNER_MEMO_LIMIT`` (read at import, default ``DEFAULT_LIMIT``) or
``set_limit``.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import warnings

LIMIT_ENV = "POOL_TUNER_MEMO_LIMIT"
#: Owners (problems, programs) held at most, and entries per table.
DEFAULT_LIMIT = 64


class Table:
    """One memo table: key -> value, each entry filed under an owner (see the module docstring)."""

    __slots__ = ("name", "_memos", "_entries", "_values", "_clock", "peek")

    def __init__(self, name: str, memos: "Memos"):
        self.name = name
        self._memos = memos
        self._entries: dict = {}  # key -> [owner, value, last use (a tick of the clock)]
        self._values: dict = {}  # key -> value: the same entries, for ``peek``
        self._clock = memos._clock
        #: ``peek(key, default=None)``: the value memoised for ``key`` without marking it as used.
        self.peek = self._values.get

    def get(self, key, default=None):
        """The value memoised for ``key``, else ``default``; marks the entry as used, which keeps its
        owner recent."""
        entry = self._entries.get(key)
        if entry is None:
            return default
        entry[2] = next(self._clock)
        return entry[1]

    def put(self, owner, key, value):
        """Memoise ``value`` for ``key``, filed under ``owner``; returns ``value``.  May evict the
        least recently used owners (perhaps ``owner`` itself, when one owner alone fills a table)."""
        self._memos._put(self, owner, key, value)
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def values(self) -> list:
        return [entry[1] for entry in list(self._entries.values())]

    def clear(self) -> None:
        """Drop every entry of this table (the other tables keep theirs)."""
        self._memos._clear_table(self)


class Memos:
    """The owners' recency order and the tables filed under them (one per process: ``MEMOS``)."""

    def __init__(self, limit: int):
        self._limit = limit
        self._lock = threading.Lock()
        self._clock = itertools.count()
        self._filed: dict = {}  # owner -> {(table, key)}
        self._tables: list = []

    def table(self, name: str) -> Table:
        """A new table under this registry's limit."""
        table = Table(name, self)
        with self._lock:
            self._tables.append(table)
        return table

    def limit(self) -> int:
        return self._limit

    def set_limit(self, limit: int) -> None:
        """Hold at most ``limit`` owners (and entries per table) from now on, evicting at once."""
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"the memo limit must be an int >= 1, got {limit!r}")
        with self._lock:
            self._limit = limit
            self._shrink(None)

    def owners(self) -> int:
        """How many owners are held now."""
        return len(self._filed)

    def sizes(self) -> dict:
        """Entries per table, by table name (tables of one name added up)."""
        sizes: dict = {}
        for table in list(self._tables):
            sizes[table.name] = sizes.get(table.name, 0) + len(table)
        return sizes

    def evict(self, owner) -> None:
        """Drop ``owner`` and its entries in every table now."""
        with self._lock:
            self._drop(owner)

    def clear(self) -> None:
        """Drop every entry of every table."""
        with self._lock:
            for table in self._tables:
                table._entries.clear()
                table._values.clear()
            self._filed.clear()

    def _put(self, table: Table, owner, key, value) -> None:
        with self._lock:
            previous = table._entries.get(key)
            if previous is not None and previous[0] != owner:
                self._unfile(previous[0], table, key)
            table._entries[key] = [owner, value, next(self._clock)]
            table._values[key] = value
            self._filed.setdefault(owner, set()).add((table, key))
            self._shrink(table)

    def _shrink(self, table: Table | None) -> None:
        """Evict least recently used owners until the limits hold (lock held)."""
        while self._filed and (len(self._filed) > self._limit
                               or (table is not None and len(table._entries) > self._limit)):
            self._drop(min(self._filed, key=self._last_use))

    def _last_use(self, owner) -> int:
        """The last use of ``owner``'s most recently used entry (lock held)."""
        return max((table._entries[key][2] for table, key in self._filed[owner]), default=-1)

    def _drop(self, owner) -> None:
        """Remove ``owner`` and its entries (lock held)."""
        for table, key in self._filed.pop(owner, ()):
            del table._entries[key]
            table._values.pop(key, None)

    def _unfile(self, owner, table: Table, key) -> None:
        """Forget that ``owner`` has ``key`` in ``table``, and the owner once it has nothing (lock held)."""
        filed = self._filed.get(owner)
        if filed is not None:
            filed.discard((table, key))
            if not filed:
                del self._filed[owner]

    def _clear_table(self, table: Table) -> None:
        with self._lock:
            for key, entry in table._entries.items():
                self._unfile(entry[0], table, key)
            table._entries.clear()
            table._values.clear()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        for table in self._tables:
            keep_alive(dict(table._entries))
            table._entries.clear()
            table._values.clear()
        self._filed.clear()


#: What a forked child inherited from its parent and must never release (``keep_alive``).
_INHERITED: list = []


def keep_alive(*objects) -> None:
    """Keep ``objects`` -- a forked child's copies of its parent's built programs, kernels, queues
    and memory pools -- referenced for the life of the process, so that the child, which forgets
    them, never releases them: releasing an OpenCL object runs the driver's code, which can wait
    forever on a lock that another thread of the parent held when it forked (PoCL's compiler
    lock), inside ``os.fork`` itself.  The memory stays the child's copy of the parent's."""
    _INHERITED.extend(objects)


_MISSING = object()


def per_owner(name: str):
    """Memoise a function of one argument in a table named ``name``, each result filed under its
    argument (a ``Problem``: per-shape facts leave with the shape's other entries)."""
    def decorate(function):
        table = MEMOS.table(name)

        @functools.wraps(function)
        def memoised(owner):
            value = table.peek(owner, _MISSING)
            if value is _MISSING:
                value = table.put(owner, owner, function(owner))
            return value

        memoised.table = table
        return memoised

    return decorate


def _limit_from_environment() -> int:
    """``LIMIT_ENV`` as an int >= 1 (unset or empty: ``DEFAULT_LIMIT``); any other value is a
    ``RuntimeWarning`` naming it, and the default -- as a switch's (``switches``): a bad value
    must not stop the user's program, or the command line, at import."""
    text = os.environ.get(LIMIT_ENV)
    if text is None or not text.strip():
        return DEFAULT_LIMIT
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        warnings.warn(f"{LIMIT_ENV}={text!r} is not an int >= 1; the limit stays {DEFAULT_LIMIT}", RuntimeWarning,
                      stacklevel=2)
        return DEFAULT_LIMIT
    return value


MEMOS = Memos(_limit_from_environment())
table = MEMOS.table
limit = MEMOS.limit
sizes = MEMOS.sizes
owners = MEMOS.owners
set_limit = MEMOS.set_limit
clear = MEMOS.clear
evict = MEMOS.evict

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=MEMOS._after_fork_in_child)

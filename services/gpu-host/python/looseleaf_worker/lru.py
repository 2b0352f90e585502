"""``functools.lru_cache`` (and ``functools.cache``) around a function a notebook
defined, with its cache kept across cells.

CPython's wrapper is a C object that pickles by reference (``__main__.fib``), which
a restore cannot resolve, and whose cache no Python code can read. In a kernel a
memoised function keeps its cache from cell to cell: the results it returns
without calling the function again, its ``cache_info()``, and any side effect the
function has only on a miss. So the worker makes the wrappers of notebook
functions (``__module__`` ``"__main__"``) this one, which behaves as the C one
(the same keys, least-recently-used eviction, statistics, method binding) and
saves its cache with it. Library functions keep the C wrapper.
"""

from __future__ import annotations

import functools
import threading
import types
from collections import OrderedDict

_C_WRAPPER = functools._lru_cache_wrapper
# attributes the wrapper sets itself; the rest (update_wrapper's) travel as state
_OWN = ("_func", "_maxsize", "_typed", "_info", "_cache", "_hits", "_misses", "_lock", "cache_parameters")


class NotebookLruCache:
    """What ``functools.lru_cache`` returns for a notebook function."""

    def __init__(self, func, maxsize, typed, cache_info_type, items=(), hits=0, misses=0):
        self._func, self._maxsize, self._typed, self._info = func, maxsize, typed, cache_info_type
        self._cache: OrderedDict = OrderedDict(items)
        self._hits, self._misses = hits, misses
        self._lock = threading.RLock()

    def __call__(self, *args, **kwds):
        if self._maxsize == 0:
            self._misses += 1
            return self._func(*args, **kwds)
        key = functools._make_key(args, kwds, self._typed)
        with self._lock:
            if key in self._cache:
                if self._maxsize is not None:
                    self._cache.move_to_end(key)
                self._hits += 1
                return self._cache[key]
            self._misses += 1
        result = self._func(*args, **kwds)  # unlocked: a recursive call comes back in
        with self._lock:
            if key not in self._cache:  # a call meanwhile stored it: as CPython, keep that
                self._cache[key] = result
                if self._maxsize is not None and len(self._cache) > self._maxsize:
                    self._cache.popitem(last=False)
        return result

    def cache_info(self):
        with self._lock:
            return self._info(self._hits, self._misses, self._maxsize, len(self._cache))

    def cache_clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self._hits = self._misses = 0

    def __get__(self, obj, objtype=None):
        # a memoised method binds as the C wrapper does
        return self if obj is None else types.MethodType(self, obj)

    def __repr__(self) -> str:
        return f"<functools._lru_cache_wrapper object at {id(self):#x}>"

    def __reduce__(self):
        # a multi-argument key is a functools._HashedSeq holding its hash, which is
        # the saving process's (string hashes differ between processes): saved
        # as a plain tuple and hashed again when restored
        items = [
            (("hashed", tuple(k)) if type(k) is functools._HashedSeq else ("key", k), v) for k, v in self._cache.items()
        ]
        state = {k: v for k, v in self.__dict__.items() if k not in _OWN}
        args = (self._func, self._maxsize, self._typed, self._info, items, self._hits, self._misses)
        return (_rebuild, args, state)


# `type(f)` reads as it does in a kernel (instances pickle through __reduce__, so
# the class is never looked up by this name)
NotebookLruCache.__name__ = NotebookLruCache.__qualname__ = "_lru_cache_wrapper"
NotebookLruCache.__module__ = "functools"


def _rebuild(func, maxsize, typed, info, items, hits, misses) -> NotebookLruCache:
    keys = [(functools._HashedSeq(k) if kind == "hashed" else k, v) for (kind, k), v in items]
    w = NotebookLruCache(func, maxsize, typed, info, keys, hits, misses)
    w.cache_parameters = lambda: {"maxsize": maxsize, "typed": typed}  # as lru_cache sets it
    return w


def _lru_cache_wrapper(user_function, maxsize, typed, cache_info_type):
    """functools' factory of wrappers: this one for notebook functions."""
    if getattr(user_function, "__module__", None) == "__main__":
        return NotebookLruCache(user_function, maxsize, typed, cache_info_type)
    return _C_WRAPPER(user_function, maxsize, typed, cache_info_type)


def install() -> None:
    """Make ``functools.lru_cache`` wrap notebook functions with NotebookLruCache
    (lru_cache looks its factory up in functools at each decoration)."""
    functools._lru_cache_wrapper = _lru_cache_wrapper

"""What a save and restore must keep exactly, however the objects were spread
over variables and cells: one identity per object (immutable ones too: a
sentinel tuple compared with ``is``), a set's iteration order, and the globals
that functions reached only through data read when called. Silent divergence is
the worst failure a notebook platform can have, so each is a property over
generated object graphs, run in process against the checkpoint code itself."""

import types

from helpers import ok, result_text, stream_text
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from looseleaf_worker import checkpoint

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _lay_out(res, path) -> dict:
    """The restore file a host would write for every object of ``res``."""
    buf, objects = bytearray(), {}

    def place(blob):
        data = b"".join(bytes(res.chunks[h]) for h in blob["chunks"])
        buf.extend(data)
        return [len(buf) - len(data), len(data)]

    for oid, spec in res.delta["objects"].items():
        objects[oid] = {"record": place(spec["record"]), "payloads": [place(p) for p in spec["payloads"]]}
    path.write_bytes(bytes(buf))
    return objects


class Session:
    """A session's committed state, as the store keeps it: each name's latest
    variable entry, and every object saved so far (its chunks included)."""

    def __init__(self, tmp_path):
        self.dir, self.n = tmp_path, 0
        self.variables: dict = {}
        self.objects: dict = {}
        self.chunks: dict = {}

    def save(self, ns: dict, names: list[str], oid_of: dict) -> checkpoint.SaveResult:
        res = checkpoint.build_delta(ns, names, oid_of, set(), None)
        assert res.delta["unsavable"] == {}
        self.variables.update(res.delta["variables"])
        self.objects.update(res.delta["objects"])
        self.chunks.update(res.chunks)
        return res

    def restore(self, names: list[str]) -> tuple[dict, dict]:
        """A fresh worker's namespace with ``names`` restored, and its oid map."""
        self.n += 1
        path = self.dir / f"restore-{self.n}"
        res = checkpoint.SaveResult({"objects": self.objects}, self.chunks, {})
        objects = _lay_out(res, path)
        ns, oid_of = {"__builtins__": __builtins__}, {}
        _, errors = checkpoint.restore(ns, str(path), {n: self.variables[n] for n in names}, objects, oid_of)
        assert errors == {}
        return ns, oid_of


# ------------------------------------------------------------ generated graphs

# Leaves that carry identity (see checkpoint._carries_identity) and containers.
ATOMS = st.one_of(
    st.tuples(st.integers(-3, 3), st.integers(-3, 3)),
    st.text(min_size=2, max_size=6),
    st.binary(min_size=2, max_size=6),
    st.frozensets(st.integers(-5, 5), min_size=2, max_size=6),
)


@st.composite
def object_graphs(draw):
    """Variables over a pool of objects, containers holding pool members (so one
    object is reached from several variables and containers)."""
    pool = draw(st.lists(ATOMS, min_size=1, max_size=5))
    n_atoms = len(pool)
    n_containers = draw(st.integers(1, 5))
    for _ in range(n_containers):
        kind = draw(st.sampled_from(["list", "dict", "tuple", "holder"]))
        members = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=6))
        if kind == "list":
            pool.append(list(members))
        elif kind == "dict":
            pool.append({f"k{i}": m for i, m in enumerate(members)})
        elif kind == "tuple":
            pool.append((*members, types.SimpleNamespace()))
        else:
            pool.append(types.SimpleNamespace(items=members))
    # every immutable leaf is some variable's value, as a sentinel is a global
    # (an unnamed tuple two containers share keeps value semantics: ADR 51)
    named = [k for k in range(len(pool)) if k < n_atoms or isinstance(pool[k], tuple)]
    chosen = draw(st.lists(st.integers(n_atoms, len(pool) - 1), min_size=1, unique=True))
    return {**{f"a{k}": pool[k] for k in named}, **{f"v{i}": pool[k] for i, k in enumerate(chosen)}}


def _positions(ns: dict, names: list[str]) -> dict[tuple, object]:
    """Every object reachable from the variables, by the path that reaches it."""
    out: dict[tuple, object] = {}

    def walk(path, obj, depth):
        out[path] = obj
        if depth > 4:
            return
        if isinstance(obj, (list, tuple)):
            for i, x in enumerate(obj):
                walk((*path, i), x, depth + 1)
        elif isinstance(obj, dict):
            for k, x in obj.items():
                walk((*path, k), x, depth + 1)
        elif isinstance(obj, types.SimpleNamespace):
            walk((*path, "items"), obj.__dict__.get("items"), depth + 1)

    for n in names:
        walk((n,), ns[n], 0)
    return out


def _same_objects(before: dict, after: dict) -> list[tuple]:
    """Pairs of paths whose `is` differs between the two namespaces."""
    paths = [p for p in before if p in after]
    kinds = (type(None), bool)
    wrong = []
    for i, a in enumerate(paths):
        if isinstance(before[a], kinds) or type(before[a]) in (int, float):
            continue  # pickle keeps no number's identity, nor does it matter
        for b in paths[i + 1 :]:
            if (before[a] is before[b]) != (after[a] is after[b]):
                wrong.append((a, b))
    return wrong


@PROPS
@given(graph=object_graphs(), data=st.data())
def test_objects_keep_one_identity_across_records_and_workers(tmp_path_factory, graph, data):
    tmp = tmp_path_factory.mktemp("identity")
    ns = {"__builtins__": __builtins__, **graph}
    names = sorted(graph)
    session = Session(tmp)
    session.save(ns, names, {})

    # a later worker restores some of the names and makes a new variable from
    # what it restored; a third worker restores everything the session has
    first = data.draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
    ns2, oid_of2 = session.restore(first)
    ns2["later"] = [ns2[n] for n in first]
    session.save(ns2, [*first, "later"], oid_of2)
    ns3, _ = session.restore([*names, "later"])

    want = {**ns, "later": [ns[n] for n in first]}
    assert _same_objects(_positions(want, [*names, "later"]), _positions(ns3, [*names, "later"])) == []


def test_a_sentinel_tuple_stays_the_object_a_grid_holds(tmp_path):
    # shared_objects.ipynb's pattern: the global and the grid's cells are one object
    session = Session(tmp_path)
    ns = {"__builtins__": __builtins__}
    exec("EMPTY = (0, 0)\ndef board(n):\n    return [[EMPTY for _ in range(n)] for _ in range(n)]", ns)
    session.save(ns, ["EMPTY", "board"], {})
    ns2, oid_of2 = session.restore(["EMPTY", "board"])
    exec("b = board(3)\nb[1][1] = (2, 2)", ns2)
    session.save(ns2, ["EMPTY", "board", "b"], oid_of2)
    # a worker that restores only the grid still holds the sentinel it shares
    ns3, oid_of3 = session.restore(["b"])
    exec("b2 = [row[:] for row in b]", ns3)
    session.save(ns3, ["b", "b2"], oid_of3)
    ns4, _ = session.restore(["EMPTY", "b", "b2"])
    assert ns4["b"][0][0] is ns4["EMPTY"] and ns4["b2"][2][2] is ns4["EMPTY"]
    assert ns4["b"][1][1] is not ns4["EMPTY"]


# ------------------------------------------------------------ set order

# Small ints collide: hash(-1) == hash(-2), and i and i + 8 share a slot of a
# small table. Sets built as cells build them: by adds, from a list, by a
# comprehension, as a union. (A set that also had elements removed keeps its
# order only where removals left no mark on its table: ADR 51.)
SET_BUILDS = st.tuples(
    st.sampled_from(["adds", "list", "comprehension", "union"]),
    st.lists(st.integers(-12, 40), min_size=2, max_size=60),
)


def _built(build) -> set:
    how, items = build
    if how == "adds":
        s = set()
        for k in items:
            s.add(k)
        return s
    if how == "list":
        return set(items)
    if how == "comprehension":
        return {k for k in items}  # noqa: C416 - a comprehension builds as it goes
    half = len(items) // 2
    return set(items[:half]) | set(items[half:])


@PROPS
@given(build=SET_BUILDS)
# a union into a 16-slot table of four elements, two of them colliding (CPython
# sized an empty set's table up front only for five keys or more)
@example(build=("union", [-1, 6, -2, -1, -1, -3]))
def test_a_set_restores_with_the_iteration_order_it_had(tmp_path_factory, build):
    s = _built(build)
    ns = {"__builtins__": __builtins__, "s": s, "f": frozenset(s), "nested": [s, {"inner": s}]}
    session = Session(tmp_path_factory.mktemp("sets"))
    session.save(ns, ["s", "f", "nested"], {})
    ns2, _ = session.restore(["s", "f", "nested"])
    assert list(ns2["s"]) == list(s)
    assert list(ns2["f"]) == list(ns["f"])
    assert ns2["nested"][0] is ns2["s"] and ns2["nested"][1]["inner"] is ns2["s"]


def test_hash_colliding_elements_keep_their_order(tmp_path):
    # shared_objects.ipynb: -1 and -2 hash alike; added in this order, a plain
    # pickle round trip prints them in another
    signs = set()
    for k in [1, 2, 3, 4, -2, -4, -3, -1]:
        signs.add(k)
    session = Session(tmp_path)
    session.save({"signs": signs}, ["signs"], {})
    ns2, _ = session.restore(["signs"])
    assert repr(ns2["signs"]) == repr(signs)


def test_a_set_in_a_reference_cycle_restores_whole(tmp_path):
    ns = {"__builtins__": __builtins__}
    exec("class Node:\n    def __hash__(self):\n        return 7\nn = Node()\nn.members = {n, 1, 2}", ns)
    session = Session(tmp_path)
    session.save(ns, ["Node", "n"], {})
    ns2, _ = session.restore(["n"])
    assert ns2["n"] in ns2["n"].members and len(ns2["n"].members) == 3


# ------------------------------------------------------------ globals read through data


@st.composite
def function_tables(draw):
    """Functions reading random globals, reachable only through nested dicts,
    lists and objects."""
    n_globals = draw(st.integers(1, 6))
    source = [f"G{i} = {i}" for i in range(n_globals)]
    reads: set[str] = set()
    funcs = []
    for f in range(draw(st.integers(1, 5))):
        used = draw(st.lists(st.integers(0, n_globals - 1), min_size=1, max_size=3, unique=True))
        reads |= {f"G{i}" for i in used}
        if draw(st.booleans()):
            source.append(f"def f{f}(x):\n    return x + " + " + ".join(f"G{i}" for i in used))
        else:
            source.append(f"f{f} = lambda x: x + " + " + ".join(f"G{i}" for i in used))
        funcs.append(f"f{f}")
    shape = draw(st.sampled_from(["dict", "list", "nested", "object"]))
    table = {
        "dict": "{" + ", ".join(f"{f!r}: {f}" for f in funcs) + "}",
        "list": "[" + ", ".join(funcs) + "]",
        "nested": "{'ops': [(" + ", ".join(funcs) + ",)]}",
        "object": "type('T', (), {})()",
    }[shape]
    source.append(f"table = {table}")
    if shape == "object":
        source.append("table.__dict__.update(" + ", ".join(f"{f}={f}" for f in funcs) + ")")
    # the functions themselves are deleted: the table is the only way to them
    source.append("del " + ", ".join(funcs))
    return "\n".join(source), reads


@PROPS
@given(table=function_tables())
def test_globals_read_by_functions_reached_through_data_are_in_the_closure(tmp_path_factory, table):
    source, reads = table
    ns = {"__builtins__": __builtins__}
    exec(source, ns)
    names = [n for n in ns if not n.startswith("__")]
    res = checkpoint.build_delta(ns, names, {}, set(), None)
    assert reads <= set(res.delta["variables"]["table"]["global_reads"])


def test_a_function_in_a_dispatch_dict_finds_its_global_in_a_later_worker(zygote):
    w1 = zygote.fork()
    ok(w1.run("FACTOR = 3\ndef triple(x):\n    return x * FACTOR\ndef negate(x):\n    return -x"))
    ok(w1.run("ops = {'triple': triple, 'negate': negate}"))
    delta = w1.save()["ready"]["delta"]
    needed = delta["variables"]["ops"]["global_reads"]
    assert "FACTOR" in needed
    # the planner restores ops with what its global_reads name
    w2 = zygote.fork()
    assert w2.restore(["ops", *needed])["ok"]
    assert result_text(ok(w2.run("ops['triple'](4), ops['negate'](ops['triple'](2))"))) == "(12, -6)"


def test_a_memoised_notebook_function_keeps_its_cache_in_a_later_worker(zygote):
    # functools.lru_cache/cache around notebook functions: the C wrapper pickles
    # by reference to __main__ and its cache is out of reach; a kernel keeps the
    # cache from cell to cell (results, cache_info, side effects only on a miss)
    setup = (
        "import functools\ncalls = []\n"
        "@functools.lru_cache(maxsize=None)\ndef fib(n):\n"
        "    calls.append(n)\n    return n if n < 2 else fib(n-1) + fib(n-2)\n"
        "@functools.lru_cache(maxsize=2, typed=True)\ndef ident(*a, **k):\n"
        "    calls.append(('ident', a))\n    return a, k\n"
        "class Area:\n    @functools.cache\n    def of(self, side):\n"
        "        calls.append(('of', side))\n        return side * side\n"
        "sq = Area()\n"
        "fib(20), ident(1, b='x'), ident(1.0, b='x'), ident('s'), sq.of(3), sq.of(3)"
    )
    later = (
        "fib(21), ident('s'), ident(1, b='x'), sq.of(3), len(calls), fib.cache_info(), ident.cache_info(),"
        " fib.cache_parameters(), type(fib).__name__, fib.__wrapped__.__name__"
    )
    # CPython's own wrapper, in this process: what a kernel answers
    ns = {"__name__": "__main__"}
    exec(setup, ns)
    kernel = repr(eval(later, ns))
    assert "CacheInfo(hits=20, misses=22, maxsize=None, currsize=22)" in kernel, kernel

    w1 = zygote.fork()
    ok(w1.run(setup))
    w1.save()
    assert stream_text(ok(w1.run(f"print(repr(({later})))"))) == kernel + "\n"  # the worker that ran it
    w2 = zygote.fork()
    assert w2.restore(["fib", "ident", "sq", "calls", "functools", "Area"])["ok"]
    assert stream_text(ok(w2.run(f"print(repr(({later})))"))) == kernel + "\n"  # a later worker


# ------------------------------------------------------------ saved but not restorable


def test_an_object_whose_saved_form_does_not_restore_is_unsavable_at_save(zygote):
    w1 = zygote.fork()
    ok(w1.run("from ll_unrestorable import Panel\npanel = Panel()\nwith_panel = {'p': panel}\nfine = [1, 2]"))
    delta = w1.save()["ready"]["delta"]
    assert set(delta["unsavable"]) == {"panel", "with_panel"}
    assert "does not restore" in delta["unsavable"]["panel"]
    assert "missing 1 required positional argument" in delta["unsavable"]["panel"]
    assert "fine" in delta["variables"]


def test_the_check_restores_nothing_into_live_classes(zygote):
    # a class pickled by value is never restored in its own worker to check it:
    # cloudpickle would reset the live class's attributes to copies
    w1 = zygote.fork()
    ok(w1.run("class Registry:\n    items = []\nRegistry.items.append(1)\nkeep = Registry.items\nr = Registry()"))
    w1.save()
    assert result_text(ok(w1.run("Registry.items is keep"))) == "True"

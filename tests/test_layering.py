"""The import graph of `dss`, `engine_patch` and `api`, lazy imports (inside functions) included:
no module imports one that imports it back (`bench` and `deploy` walked too), the rooms import one way only
(`api` → `engine_patch.setup` → `engine_patch.connector` → `dss`), and `api` imports from `dss`
only what the rule in docs/architecture.md ("What `api/` may import from `dss`") allows. And
one owner per table: only it names the table's model class or the table in raw SQL
(`test_only_a_tables_owner_reaches_it`). And no two modules of `dss` share a file name
(`test_no_module_name_repeats_inside_dss`)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dss", "engine_patch", "api")
# (importer prefix, forbidden import prefix)
FORBIDDEN = [
    ("dss", "engine_patch"),
    ("dss", "api"),
    ("engine_patch", "api"),
    ("engine_patch.connector", "engine_patch.setup"),
    # Inside `api`: the vLLM engine (`api.llm`) knows no turn, shape or route; the turn pipeline
    # (`api.turn`) knows no route and gets its reply from the route, not from a shape it picks;
    # the wire shapes know no route.
    ("api.llm", "api.turn"),
    ("api.llm", "api.shapes"),
    ("api.llm", "api.routes"),
    ("api.turn", "api.routes"),
    ("api.turn", "api.shapes.chat_completion"),
    ("api.turn", "api.shapes.openai_responses"),
    ("api.shapes", "api.routes"),
]
# Inside `dss` (docs/architecture.md): `ops` combines the parts (`index`, `pages`, `keys`,
# `dialogue`, `fleet`), which do not import each other sideways nor anything above them; what two
# of them share lives below both (`dss.tokens`, `dss.types`, `dss.derive`, `dss.config`). The
# settings (`dss.config`) import no part. One exception, by name: the page files and rows are
# encrypted with the AES-GCM primitives of `dss.keys.crypto` (a module with no part below it).
_PARTS = ("dss.index", "dss.pages", "dss.keys", "dss.dialogue", "dss.fleet")
_ABOVE_PARTS = ("dss.ops", "dss.store", "dss.rpc")
FORBIDDEN += [(part, other) for part in _PARTS for other in (*_PARTS, *_ABOVE_PARTS) if other != part]
FORBIDDEN += [("dss.config", other) for other in (*_PARTS, *_ABOVE_PARTS)]
# (importer prefix, exact module it may import although FORBIDDEN says otherwise)
ALLOWED = {("dss.pages", "dss.keys"), ("dss.pages", "dss.keys.crypto")}

# What `api` may import from `dss` (docs/architecture.md): the composition root, the shared
# vocabulary, and the public interfaces of the parts `Store` exposes; `dss.db` for the API's own
# table (API keys) and the offline commands. Never the machinery under the parts.
API_MAY_IMPORT = (
    "dss.store",
    "dss.errors",
    "dss.types",
    "dss.tokens",
    "dss.inputs",
    "dss.wire",
    "dss.jsonlimits",
    "dss.config",
    "dss.dialogue",
    "dss.ops",
    "dss.keys",
    "dss.db",
)


# The cycle check also walks these (scripts and their helpers, importing the packages above).
# Imports under `if TYPE_CHECKING:` never run and are left out everywhere: bench/_soak's modules
# name each other's classes in annotations that way (a cycle of names, not of imports).
CYCLE_WALKED = (*PACKAGES, "deploy", "bench")


def modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The project modules `name` imports, anywhere in its body (TYPE_CHECKING blocks aside: they
    are never executed)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                yield t


def graph(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    known = modules(packages)
    return {name: set(imports(name, path, known)) for name, path in known.items()}


def test_rooms_import_one_way() -> None:
    bad = [
        f"{m} imports {t}"
        for m, targets in graph().items()
        for t in targets
        for importer, forbidden in FORBIDDEN
        if (m == importer or m.startswith(importer + "."))
        and (t == forbidden or t.startswith(forbidden + "."))
        and not any((m == i or m.startswith(i + ".")) and t == allowed for i, allowed in ALLOWED)
    ]
    assert not bad, "\n".join(sorted(bad))


def api_imports_outside_the_rule(g: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} imports {t}"
        for m, targets in g.items()
        if m == "api" or m.startswith("api.")
        for t in targets
        if (t == "dss" or t.startswith("dss."))
        and t != "dss"  # `from dss import errors`: the package itself, then the module
        and not any(t == allowed or t.startswith(allowed + ".") for allowed in API_MAY_IMPORT)
    )


def test_api_imports_from_dss_only_what_the_rule_allows() -> None:
    bad = api_imports_outside_the_rule(graph())
    assert not bad, "\n".join(bad)


def test_the_api_rule_catches_a_reach_into_the_machinery() -> None:
    g = {"api.fake": {"dss.pages.table", "dss.store", "dss.index.hashing", "dss.ops.kv"}}
    assert api_imports_outside_the_rule(g) == [
        "api.fake imports dss.index.hashing",
        "api.fake imports dss.pages.table",
    ]


def import_cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `g` (its strongly connected components of more than one module)."""
    # A package's __init__ re-exporting its modules is not a cycle of concepts: edges from a
    # package to its own submodules are left out.
    g = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in g.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:  # Tarjan
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    return cycles


def test_no_import_cycles() -> None:
    cycles = import_cycles(graph(CYCLE_WALKED))
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_cycle() -> None:
    g = {"bench.a": {"bench.b"}, "bench.b": {"bench.a"}, "bench.c": {"bench.a"}}
    assert import_cycles(g) == [["bench.a", "bench.b"]]


def test_the_arena_format_stands_alone() -> None:
    """`engine_patch.connector` and the page-codec helpers map arenas: the format module needs
    nothing of the store beyond the shared types, errors and its directory checks."""
    allowed = {"dss.errors", "dss.types", "dss.wire", "dss.pages.tiers.host.shm"}
    g = graph()
    assert g["dss.pages.tiers.host.arena"] <= allowed, g["dss.pages.tiers.host.arena"] - allowed
    assert g["dss.pages.tiers.host.shm"] <= allowed, g["dss.pages.tiers.host.shm"] - allowed


# Methods that only pass their own call on, unchanged, to the same-named method of one of their
# object's attributes (`def f(self, a): return self.x.f(a)`): a caller should call the owner.
# At most this many in the source (issue 29: 33 before; a wrapper of a container's one method,
# such as `BoundedLru.clear`, is fine).
MAX_FORWARDERS = 5


def _is_forwarder(fn: ast.FunctionDef) -> bool:
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return | ast.Expr):
        return False
    call = body[0].value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
        return False
    owner = call.func.value
    on_self = isinstance(owner, ast.Attribute) and ast.unparse(owner.value) == "self"
    if call.func.attr != fn.name or not on_self:
        return False
    params = [a.arg for a in fn.args.args[1:] + fn.args.kwonlyargs]
    passed = [a.id for a in call.args if isinstance(a, ast.Name)]
    passed += [k.value.id for k in call.keywords if isinstance(k.value, ast.Name)]
    return len(passed) == len(call.args) + len(call.keywords) and sorted(passed) == sorted(params)


def forwarders() -> list[str]:
    found = []
    for package in ("dss", "api", "engine_patch"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for cls in ast.walk(ast.parse(path.read_text())):
                if isinstance(cls, ast.ClassDef):
                    found += [
                        f"{path.relative_to(ROOT)}:{cls.name}.{f.name}"
                        for f in cls.body
                        if isinstance(f, ast.FunctionDef) and _is_forwarder(f)
                    ]
    return found


def test_few_methods_only_pass_a_call_on() -> None:
    found = forwarders()
    assert len(found) <= MAX_FORWARDERS, found


def test_the_forwarder_count_sees_one() -> None:
    source = "class K:\n    def f(self, a, *, b):\n        '''doc'''\n        return self.x.f(a, b=b)\n"
    tree = ast.parse(source)
    cls = tree.body[0]
    assert isinstance(cls, ast.ClassDef) and isinstance(cls.body[0], ast.FunctionDef)
    assert _is_forwarder(cls.body[0])


# One owner per table. `dss.db.models.TABLE_OWNERS` names, for each table, the module or package
# whose code alone reads and writes it; every other part asks the owner (a method that takes the
# caller's transaction where the work must stay in one). A module that names a model class
# (`select(X)`, `delete(X)`, `X.column`, `db.get(X, ...)`, `X(...)`) outside its table's owner
# is a reach into another part's data, which the import rules above cannot see. So is raw SQL
# naming the table (`FROM t`, `INTO t`, `UPDATE t`, `JOIN t`, `TABLE t` in a string literal that is
# not a docstring) outside its owner.
# (module prefix, table) pairs allowed to reach anyway, each with its reason:
TABLE_REACHES_ALLOWED = {
    # The schema: the models themselves and the migrations that build and move the tables.
    ("dss.db.models", "*"): "the schema",
    ("migrations", "*"): "the schema's history",
    # Benchmarks measure and fabricate rows as tests do (tests are not walked).
    ("bench.verify", "erasure_receipts"): "fabricates 20,000 receipts to time a verification",
    ("bench.dialogue_commits", "versions"): "measures the bytes the versions table holds",
}
TABLE_WALKED = ("dss", "api", "engine_patch", "deploy", "bench", "migrations")


def _model_tables() -> dict[str, str]:
    """Model class name -> table name, from `dss/db/models.py`."""
    out = {}
    for node in ast.parse((ROOT / "dss/db/models.py").read_text()).body:
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if (
                    isinstance(stmt, ast.Assign)
                    and [ast.unparse(t) for t in stmt.targets] == ["__tablename__"]
                    and isinstance(stmt.value, ast.Constant)
                ):
                    out[node.name] = str(stmt.value.value)
    return out


def _table_owners() -> dict[str, str]:
    """`TABLE_OWNERS` of `dss/db/models.py`, read without importing it."""
    for node in ast.parse((ROOT / "dss/db/models.py").read_text()).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            if ast.unparse(target) == "TABLE_OWNERS" and node.value is not None:
                owners = ast.literal_eval(node.value)
                assert isinstance(owners, dict)
                return owners
    raise AssertionError("dss/db/models.py declares no TABLE_OWNERS")


def tables_referenced(source: str, tables: dict[str, str]) -> set[str]:
    """The tables whose model classes `source` names (imports aside): `X` imported from
    `dss.db.models`, or `m.X` with `m` the module imported under any name."""
    tree = ast.parse(source)
    direct: dict[str, str] = {}  # local name -> model class
    module_names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "dss.db.models":
            direct.update({a.asname or a.name: a.name for a in node.names if a.name in tables})
        elif isinstance(node, ast.ImportFrom) and node.module == "dss.db":
            module_names.update(a.asname or a.name for a in node.names if a.name == "models")
        elif isinstance(node, ast.Import):
            module_names.update(a.asname or a.name for a in node.names if a.name == "dss.db.models")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in direct:
            found.add(tables[direct[node.id]])
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in tables
            and ast.unparse(node.value) in module_names
        ):
            found.add(tables[node.attr])
    return found


_RAW_SQL_TABLE = re.compile(r"\b(?:FROM|INTO|UPDATE|JOIN|TABLE)\s+[\"`]?(\w+)", re.IGNORECASE)


def tables_in_raw_sql(source: str, table_names: Iterable[str]) -> set[str]:
    """The tables that the string literals of `source` name after an SQL keyword (`SELECT .. FROM
    t`, `INSERT INTO t`, `UPDATE t`, `DELETE FROM t`, ...), docstrings and other bare string
    statements aside (prose, not SQL); the literal parts of f-strings included."""
    tree = ast.parse(source)
    bare = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    names = set(table_names)
    return {
        m.group(1)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in bare
        for m in _RAW_SQL_TABLE.finditer(node.value)
        if m.group(1) in names
    }


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def table_reaches(sources: dict[str, str], owners: dict[str, str], tables: dict[str, str]) -> list[str]:
    return sorted(
        f"{module} reaches {table} (owned by {owners[table]})"
        for module, source in sources.items()
        for table in tables_referenced(source, tables) | tables_in_raw_sql(source, owners)
        if not _within(module, owners[table])
        and not any(
            _within(module, prefix) and allowed in (table, "*") for prefix, allowed in TABLE_REACHES_ALLOWED
        )
    )


def _sources(packages: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for pkg in packages:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path.read_text()
    return out


def test_every_table_has_one_owner() -> None:
    owners, tables = _table_owners(), _model_tables()
    assert sorted(owners) == sorted(tables.values()), "tables without an owner, or owners of no table"


def test_only_a_tables_owner_reaches_it() -> None:
    bad = table_reaches(_sources(TABLE_WALKED), _table_owners(), _model_tables())
    assert not bad, "\n".join(bad)


def test_the_owner_check_sees_every_kind_of_reach() -> None:
    tables = {"PageRow": "pages", "DataKey": "data_keys", "SessionRow": "sessions"}
    owners = {"pages": "dss.pages", "data_keys": "dss.keys", "sessions": "dss.dialogue"}
    sources = {
        "dss.ops.a": "from dss.db.models import PageRow as P\ndelete(P).where(P.tenant == t)\n",
        "dss.ops.b": "from dss.db import models as m\ns.get(m.DataKey, t)\n",
        "dss.ops.c": "import dss.db.models\nx = dss.db.models.SessionRow(id='s')\n",
        "dss.pages.rows": "from dss.db.models import PageRow\nselect(PageRow)\n",
        "dss.ops.d": 'c.exec_driver_sql("SELECT coalesce(max(seq), 0) FROM data_keys")\n',
        "dss.ops.e": 'text(f"delete from pages where id = {i}")\n',
        "dss.ops.h": 'q = f"UPDATE sessions SET a = {v}"\n',
        "dss.ops.f": '"""Deleting from sessions, inserting into pages: prose."""\nlog.info("no SQL")\n',
        "dss.pages.g": 'text("DELETE FROM pages")\n',
    }
    assert table_reaches(sources, owners, tables) == [
        "dss.ops.a reaches pages (owned by dss.pages)",
        "dss.ops.b reaches data_keys (owned by dss.keys)",
        "dss.ops.c reaches sessions (owned by dss.dialogue)",
        "dss.ops.d reaches data_keys (owned by dss.keys)",
        "dss.ops.e reaches pages (owned by dss.pages)",
        "dss.ops.h reaches sessions (owned by dss.dialogue)",
    ]


def test_the_turn_imports_no_shape() -> None:
    """The turn pipeline (`api.turn`) runs a turn and yields its events; the wire shapes
    (`api.shapes`) format them and import the turn, never the reverse: no module of `api.turn`
    imports one of `api.shapes`, lazily or not, so the two packages form no cycle."""
    g = graph()

    def edges(src: str, dst: str) -> list[str]:
        return sorted(
            f"{m} imports {t}"
            for m, targets in g.items()
            if m.startswith(src + ".")
            for t in targets
            if t == dst or t.startswith(dst + ".")
        )

    assert not edges("api.turn", "api.shapes")
    assert edges("api.shapes", "api.turn"), "the shapes format the turn's events"


def repeated_module_names(root: Path) -> dict[str, list[str]]:
    """Basenames that more than one module under `root` has (`__init__.py` aside), each with its
    files, relative to `root`'s parent."""
    by_name: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if path.name != "__init__.py" and "__pycache__" not in path.parts:
            by_name.setdefault(path.name, []).append(path.relative_to(root.parent).as_posix())
    return {name: paths for name, paths in by_name.items() if len(paths) > 1}


def test_no_module_name_repeats_inside_dss() -> None:
    """A module name met in a log line, a traceback or a doc points at one file of `dss` (issue 29:
    `sessions.py`, `rows.py`, `store.py`, ... each named two modules)."""
    repeats = repeated_module_names(ROOT / "dss")
    assert not repeats, "\n".join(f"{name}: {', '.join(paths)}" for name, paths in repeats.items())


def test_the_name_check_sees_a_repeat(tmp_path: Path) -> None:
    for path in ("pkg/__init__.py", "pkg/a/__init__.py", "pkg/a/rows.py", "pkg/b/rows.py", "pkg/c.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert repeated_module_names(tmp_path / "pkg") == {"rows.py": ["pkg/a/rows.py", "pkg/b/rows.py"]}

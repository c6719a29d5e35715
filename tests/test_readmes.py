"""Every package says what it is (docs/architecture.md, "Where each concept lives"): each folder
of `dss/`, `api/`, `engine_patch/`, `deploy/` and `bench/` that holds a `.py` file has a
`README.md`, and the module tables of those READMEs match the files.

- Forward (every README): a backticked `name.py` in a table row names a file of that package, or
  of a subfolder the README names (`` `connector/` ``), or (with a `/`) a path from the repository
  root; a README that lists a module that moved or was removed fails.
- Reverse (every folder, the ones another README covers included): every module but
  `__init__.py` is named, as a backticked `name.py` in a table row of its package's README, so a
  new module (a new benchmark script too) cannot go undescribed.

And tests/ mirrors the source tree (tests/README.md, "Where a test goes"): each folder of tests is
the test folder of a source package, and a test module's name is unique across tests/.

No engine, no server: the files are read when the test runs.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.paths import REPO

ROOTS = ("dss", "api", "engine_patch", "deploy", "bench")
# Folders with Python files but no README.md of their own: folder -> the README that covers them
# (its tables list their modules, checked like a README of their own).
COVERED_BY = {
    # The connector and the engine set-up are the two rooms of one package; engine_patch/README.md
    # describes both, a table each (`connector/`, `setup/`).
    "engine_patch/connector": "engine_patch/README.md",
    "engine_patch/setup": "engine_patch/README.md",
}

_PY = re.compile(r"`([\w./-]+\.py)`")
_FOLDER = re.compile(r"`([\w.-]+)/`")


def python_folders() -> list[str]:
    """Every folder under ROOTS that holds a `.py` file (caches aside), relative to the repo."""
    found = {
        path.parent.relative_to(REPO).as_posix()
        for root in ROOTS
        for path in (REPO / root).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    return sorted(found)


def table_modules(readme: Path) -> set[str]:
    """The backticked `*.py` names in the table rows of a README."""
    return {
        name
        for line in readme.read_text().splitlines()
        if line.lstrip().startswith("|")
        for name in _PY.findall(line)
    }


def named_folders(readme: Path) -> set[str]:
    """The subfolders a README names (`` `sub/` ``), anywhere in it."""
    return set(_FOLDER.findall(readme.read_text()))


def readme_of(folder: str) -> Path:
    return REPO / COVERED_BY.get(folder, f"{folder}/README.md")


def test_every_python_folder_has_a_readme() -> None:
    missing = [
        folder
        for folder in python_folders()
        if folder not in COVERED_BY and not (REPO / folder / "README.md").is_file()
    ]
    assert not missing, "no README.md in: " + ", ".join(missing)
    for folder, readme in COVERED_BY.items():
        assert (REPO / folder).is_dir(), f"{folder} is gone: drop it from COVERED_BY"
        assert (REPO / readme).is_file(), f"{readme} (covering {folder}) is gone"


def missing_modules(readme: Path, root: Path = REPO) -> list[str]:
    """The `*.py` names of a README's tables that name no file of its package or of a subfolder
    it names; a name with a `/` may also be a path from the repository root
    (`tests/bench/test_soak.py`)."""
    base = readme.parent
    places = [base, *(base / sub for sub in named_folders(readme))]
    return sorted(
        name
        for name in table_modules(readme)
        if not any((place / name).is_file() for place in places)
        and not ("/" in name and (root / name).is_file())
    )


def test_readme_tables_name_only_modules_that_exist() -> None:
    readmes = {readme_of(folder) for folder in python_folders()}
    bad = [
        f"{readme.relative_to(REPO)} names {name}, which is not there"
        for readme in sorted(readmes)
        if readme.is_file()
        for name in missing_modules(readme)
    ]
    assert not bad, "\n".join(bad)


def unlisted_modules(folder: str) -> list[str]:
    """The modules of `folder` (not `__init__.py`) its README's tables do not name."""
    readme = readme_of(folder)
    if not readme.is_file():
        return []  # test_every_python_folder_has_a_readme says so
    named = table_modules(readme)
    prefix = Path(folder).relative_to(readme.parent.relative_to(REPO)).as_posix()
    prefix = "" if prefix == "." else prefix + "/"
    return sorted(
        f"{folder}/{path.name}"
        for path in (REPO / folder).glob("*.py")
        if path.name != "__init__.py" and path.name not in named and prefix + path.name not in named
    )


def test_every_module_is_named_in_its_readme() -> None:
    bad = [module for folder in python_folders() for module in unlisted_modules(folder)]
    assert not bad, "not in their package's README table: " + ", ".join(bad)


def test_the_checks_catch_drift(tmp_path: Path) -> None:
    """A table row naming a module that is gone is reported; one naming a file of a named
    subfolder is not."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    for path in ("pkg/here.py", "pkg/sub/there.py", "other/far.py"):
        (tmp_path / path).write_text("")
    readme = pkg / "README.md"
    readme.write_text(
        "`sub/` holds more.\n\n| module | job |\n| --- | --- |\n"
        "| `here.py` | here |\n| `there.py` | in sub |\n| `gone.py` | moved |\n"
        "| `far.py` | elsewhere, bare |\n| `other/far.py` | from the root |\n"
        "Prose naming `elsewhere.py` is not a table row.\n"
    )
    assert table_modules(readme) == {"here.py", "there.py", "gone.py", "far.py", "other/far.py"}
    assert missing_modules(readme, tmp_path) == ["far.py", "gone.py"]


# ------------------------------------------------ tests/ mirrors the source tree (tests/README.md)

# Test folders whose source folder is no Python package: test folder -> its source folder's job.
MIRRORED_NON_PACKAGES = {
    "tests/bench": "bench/: the benchmark scripts, run as scripts",
    "tests/api/console": "api/console/: the web console's static files (no Python)",
}
WHOLE_SERVER = "the whole server"
# The test modules directly in tests/api/, each with what it mainly tests: one of `api`'s own
# top-level modules (a file of api/), or the whole server (routes, turn, engine and store together,
# no single package). Every other api test lives in the folder of its subpackage.
API_TOP_LEVEL = {
    "test_unit.py": "api/settings.py",  # settings, error mapping, keys and auth modes, no engine
    "test_devmode.py": "api/auth.py",
    "test_access_log.py": "api/middleware.py",
    "test_auth_before_body.py": "api/middleware.py",
    "test_routing.py": "api/middleware.py",
    "test_slow_clients.py": "api/connections.py",
    "test_master_key_env.py": "api/app.py",
    "test_restart.py": WHOLE_SERVER,
    "test_tenancy.py": WHOLE_SERVER,
    "test_schema.py": WHOLE_SERVER,
    "test_clients.py": WHOLE_SERVER,
    "test_open_webui.py": WHOLE_SERVER,
}


def folders_with_tests() -> list[str]:
    """Every folder under tests/ that holds a `test_*.py`, relative to the repo."""
    return sorted({path.parent.relative_to(REPO).as_posix() for path in (REPO / "tests").rglob("test_*.py")})


def test_tests_mirror_the_source_tree() -> None:
    """A test folder is tests/ itself or tests/X/Y for a package X/Y (an `__init__.py`) of the
    source, or one of MIRRORED_NON_PACKAGES; each is a package itself; and tests/api/ holds only
    the modules API_TOP_LEVEL names."""
    bad = []
    for folder in folders_with_tests():
        if folder == "tests":
            continue
        if not (REPO / folder / "__init__.py").is_file():
            bad.append(f"{folder} has no __init__.py")
        source = REPO / Path(folder).relative_to("tests")
        if not (source / "__init__.py").is_file() and folder not in MIRRORED_NON_PACKAGES:
            bad.append(f"{folder} mirrors no package ({source.relative_to(REPO)}/__init__.py)")
    for folder in MIRRORED_NON_PACKAGES:
        if not (REPO / Path(folder).relative_to("tests")).is_dir():
            bad.append(f"{folder}: its source folder is gone; drop it from MIRRORED_NON_PACKAGES")
    top = sorted(path.name for path in (REPO / "tests" / "api").glob("test_*.py"))
    bad += [
        f"tests/api/{name} belongs in the folder of the api package it tests"
        for name in top
        if name not in API_TOP_LEVEL
    ]
    for name, tested in API_TOP_LEVEL.items():
        if name not in top:
            bad.append(f"tests/api/{name} is gone: drop it from API_TOP_LEVEL")
        if tested != WHOLE_SERVER and not (REPO / tested).is_file():
            bad.append(f"tests/api/{name} tests {tested}, which is gone")
    bad += [
        f"tests/engine_patch/{path.name}: engine_patch has no module of its own"
        for path in (REPO / "tests" / "engine_patch").glob("test_*.py")
    ]
    assert not bad, "\n".join(bad)


def test_test_module_names_are_unique() -> None:
    """A module name met in a log or a doc points at one file (tests/README.md)."""
    seen: dict[str, list[str]] = {}
    for path in (REPO / "tests").rglob("test_*.py"):
        seen.setdefault(path.name, []).append(path.relative_to(REPO).as_posix())
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}

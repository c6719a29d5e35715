"""The docs are executable: every curl and Python example of `README.md` and `docs/*.md` runs
against a live `dss serve`, so an example that breaks fails the suite.

What runs: fenced ```bash / ```sh / ```shell / ```console blocks that contain `curl` (a console
block's `$ ` lines), and every ```python block. The files are read when the tests run, so
examples added later are covered without touching this file. Within a file the blocks run in
document order, as a reader would type them: shell variables a block sets are there in the
file's later shell blocks (a terminal session), Python blocks share one interpreter (a REPL), and
Python sees the environment the shell blocks exported (`export DSS=...`).

How they run: shell blocks with `bash -euo pipefail`, where `curl` is
`curl --fail-with-body --show-error --max-time ...` (a non-2xx answer fails the example);
Python blocks raise on errors by themselves (the `openai` client does; httpx examples call
`raise_for_status()`).

The one server (development mode, so both the README's `X-DSS-User` examples and the API
reference's keys work; small caches) is started once for the module. The documented address and
data directory are replaced by the test server's (`SUBSTITUTIONS`): `http://127.0.0.1:8000`,
`127.0.0.1:8000`, `localhost:8000` and `~/.local/share/dss`; nothing else is rewritten.

Markers, an HTML comment on the line(s) right before a block's opening fence:

- `<!-- doc-test: skip REASON -->`: not run; the reason is required (keep these rare).
- `<!-- doc-test: run -->`: a shell block without `curl` runs too (a set-up block: keys, variables).
- `<!-- doc-test: expect-error CODE -->`: the block documents an error: it must fail (a non-2xx
  `curl`, or a Python exception) and its output must contain CODE (the error's `code`).
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.api_server import REPO, ApiServer, model_dir

DOC_FILES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
PYTHON_LANGS = {"python", "py"}
BLOCK_TIMEOUT_S = 180.0
CURL_MAX_TIME_S = 150

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<lang>[\w+-]*)[^\n]*$")
_MARKER = re.compile(r"^[ \t]*<!--\s*doc-test:\s*(?P<body>.*?)\s*-->[ \t]*$")
_DIRECTIVES = ("skip", "run", "expect-error")


@dataclass
class Block:
    path: str  # relative to the repository
    line: int  # the opening fence's line, 1-based
    lang: str
    text: str
    directives: dict[str, str] = field(default_factory=dict)

    @property
    def kind(self) -> str | None:
        """`shell` or `python` when the block is an example that runs, else None."""
        if self.lang in PYTHON_LANGS:
            return "python"
        if self.lang in SHELL_LANGS and ("curl" in self.text or "run" in self.directives):
            return "shell"
        return None

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line} ({self.lang})"


class DocSyntaxError(ValueError):
    pass


def parse_blocks(path: str, source: str) -> list[Block]:
    """Every fenced block of a Markdown file with the doc-test markers right before it."""
    lines = source.splitlines()
    blocks: list[Block] = []
    pending: dict[str, str] = {}
    pending_line = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = _MARKER.match(line)
        if marker is not None:
            name, _, arg = marker["body"].partition(" ")
            if name not in _DIRECTIVES:
                raise DocSyntaxError(f"{path}:{i + 1}: unknown doc-test directive {name!r}")
            if name in ("skip", "expect-error") and not arg.strip():
                raise DocSyntaxError(f"{path}:{i + 1}: `doc-test: {name}` needs an argument")
            pending[name] = arg.strip()
            pending_line = i + 1
            i += 1
            continue
        fence = _FENCE.match(line)
        if fence is None:
            if line.strip() and pending:
                raise DocSyntaxError(f"{path}:{pending_line}: a doc-test marker must precede a block")
            i += 1
            continue
        indent, mark, lang = fence["indent"], fence["fence"], fence["lang"].lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(mark):
            raw = lines[i]
            body.append(raw[len(indent) :] if raw.startswith(indent) else raw.lstrip())
            i += 1
        if i == len(lines):
            raise DocSyntaxError(f"{path}:{start + 1}: unclosed code block")
        i += 1  # the closing fence
        text = "\n".join(body) + "\n"
        if lang == "console":
            text = _console_commands(text)
        blocks.append(Block(path, start + 1, lang, text, pending))
        pending = {}
    if pending:
        raise DocSyntaxError(f"{path}:{pending_line}: a doc-test marker must precede a block")
    return blocks


def _console_commands(text: str) -> str:
    """The commands of a console transcript: `$ ` lines and their `\\` continuations."""
    out: list[str] = []
    continued = False
    for line in text.splitlines():
        if continued or line.startswith("$ "):
            out.append(line[2:] if not continued else line)
            continued = line.rstrip().endswith("\\")
    return "\n".join(out) + "\n"


def doc_examples(path: str) -> list[Block]:
    return [b for b in parse_blocks(path, (REPO / path).read_text()) if b.kind is not None]


# ------------------------------------------------------------------------------- without a server
def test_doc_markers_are_well_formed_and_examples_are_found() -> None:
    """Every marker parses and sits on a block, a skip says why, and the extractor finds the
    examples (a change of the fence syntax must not make this test pass by running nothing)."""
    found = {path: doc_examples(path) for path in DOC_FILES}
    for blocks in found.values():
        for b in blocks:
            if "expect-error" in b.directives and "skip" in b.directives:
                pytest.fail(f"{b.where}: a block is skipped or expected to fail, not both")
            if "run" in b.directives and b.lang not in SHELL_LANGS:
                pytest.fail(f"{b.where}: `doc-test: run` is for shell blocks")
    readme = found["README.md"]
    api = found["docs/api.md"]
    assert sum(b.kind == "shell" for b in readme) >= 1 and sum(b.kind == "python" for b in readme) >= 1
    assert sum(b.kind == "shell" for b in api) >= 15 and sum(b.kind == "python" for b in api) >= 5
    skipped = [b for bs in found.values() for b in bs if "skip" in b.directives]
    assert len(skipped) <= 3, [b.where for b in skipped]  # skips stay rare


def test_generating_examples_pass_a_small_max_tokens() -> None:
    """A generation without `max_tokens` runs to the server's default (512 tokens: 15-25 s on 2
    CPU cores): every example that generates says how many tokens it wants."""
    starters = re.compile(r"/v1/chat/completions|/messages\b|chat\.completions\.create\(")
    limits = re.compile(r"max_tokens|max_completion_tokens|max_output_tokens")
    for path in DOC_FILES:
        for b in doc_examples(path):
            calls = len(starters.findall(b.text))
            assert len(limits.findall(b.text)) >= calls, f"{b.where}: a generation without max_tokens"


def test_parser_reads_markers_console_and_indented_blocks() -> None:
    doc = (
        "text\n\n<!-- doc-test: skip needs a second server -->\n```bash\ncurl -s x\n```\n\n"
        "- item\n\n  ```python\n  print(1)\n  ```\n\n"
        "<!-- doc-test: expect-error session_not_found -->\n```console\n$ curl -s a \\\n  -H b\nout\n```\n"
        "```bash\nmake serve\n```\n"
    )
    blocks = parse_blocks("x.md", doc)
    assert [(b.lang, b.kind, b.directives) for b in blocks] == [
        ("bash", "shell", {"skip": "needs a second server"}),
        ("python", "python", {}),
        ("console", "shell", {"expect-error": "session_not_found"}),
        ("bash", None, {}),
    ]
    assert blocks[1].text == "print(1)\n" and blocks[2].text == "curl -s a \\\n  -H b\n"
    with pytest.raises(DocSyntaxError, match="needs an argument"):
        parse_blocks("x.md", "<!-- doc-test: skip -->\n```bash\ncurl x\n```\n")
    with pytest.raises(DocSyntaxError, match="must precede a block"):
        parse_blocks("x.md", "<!-- doc-test: run -->\nprose\n```bash\nls\n```\n")
    with pytest.raises(DocSyntaxError, match="unknown"):
        parse_blocks("x.md", "<!-- doc-test: maybe -->\n```bash\ncurl x\n```\n")


# ------------------------------------------------------------------------------------ the runners
_SHELL_PROLOGUE = f"""\
set -euo pipefail
curl() {{ command curl --fail-with-body --show-error --max-time {CURL_MAX_TIME_S} "$@"; }}
if [[ -f "$DOC_TEST_STATE/vars.sh" ]]; then source "$DOC_TEST_STATE/vars.sh"; fi
"""
# After the block: the variables it set (for the file's later shell blocks) and its environment
# (for Python: only what it exported).
_SHELL_EPILOGUE = """
__doc_new=$(compgen -v | grep -vxF -f "$DOC_TEST_STATE/base_names" | grep -vx __doc_new || true)
if [[ -n "$__doc_new" ]]; then declare -p $__doc_new > "$DOC_TEST_STATE/vars.sh"; fi
env -0 > "$DOC_TEST_STATE/env"
"""

_PY_RUNNER = r"""
import contextlib, io, json, os, sys, traceback
ns = {"__name__": "__main__"}
real_stdout = sys.stdout
for line in sys.stdin:
    msg = json.loads(line)
    os.environ.clear()
    os.environ.update(msg["env"])
    buf = io.StringIO()
    ok = True
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            exec(compile(msg["code"], msg["name"], "exec"), ns)
    except BaseException:
        ok = False
        buf.write(traceback.format_exc())
    real_stdout.write(json.dumps({"ok": ok, "output": buf.getvalue()}) + "\n")
    real_stdout.flush()
"""


@dataclass
class Outcome:
    ok: bool
    output: str
    seconds: float


class DocSession:
    """One file's examples: a shell "terminal" (variables carried from block to block) and one
    Python interpreter, both in the repository root."""

    def __init__(self, state_dir: Path, env: dict[str, str]) -> None:
        self.state = state_dir
        self.base_env = {**env, "DOC_TEST_STATE": str(state_dir)}
        self.env = dict(self.base_env)  # what the shell blocks exported so far
        self.python: subprocess.Popen[str] | None = None
        names = subprocess.run(
            ["bash", "-c", _SHELL_PROLOGUE + "compgen -v"],
            env=self.base_env, cwd=REPO, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        (state_dir / "base_names").write_text(names + "DOC_TEST_STATE\n")

    def run_shell(self, code: str) -> Outcome:
        began = time.monotonic()
        script = self.state / "block.sh"
        script.write_text(_SHELL_PROLOGUE + code + _SHELL_EPILOGUE)
        try:
            done = subprocess.run(
                ["bash", str(script)], env=self.env, cwd=REPO, capture_output=True, text=True,
                timeout=BLOCK_TIMEOUT_S,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            output = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            return Outcome(False, f"timed out after {BLOCK_TIMEOUT_S} s\n{output}", time.monotonic() - began)
        output = done.stdout + done.stderr
        if done.returncode == 0:
            exported = (self.state / "env").read_text().split("\0")
            self.env = dict(self.base_env)
            for item in exported:
                name, sep, value = item.partition("=")
                if sep and name not in ("DOC_TEST_STATE", "_", "SHLVL", "PWD", "OLDPWD"):
                    self.env[name] = value
        else:
            output += f"\n(exit status {done.returncode})"
        return Outcome(done.returncode == 0, output, time.monotonic() - began)

    def run_python(self, code: str, name: str) -> Outcome:
        began = time.monotonic()
        if self.python is None:
            self.python = subprocess.Popen(
                [sys.executable, "-c", _PY_RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, cwd=REPO, env=self.base_env, text=True,
            )  # fmt: skip
        proc = self.python
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps({"code": code, "name": name, "env": self.env}) + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], BLOCK_TIMEOUT_S)
        if not ready:
            self.close()
            return Outcome(False, f"timed out after {BLOCK_TIMEOUT_S} s", time.monotonic() - began)
        line = proc.stdout.readline()
        if not line:
            self.close()
            return Outcome(False, "the Python interpreter exited", time.monotonic() - began)
        answer = json.loads(line)
        return Outcome(bool(answer["ok"]), str(answer["output"]), time.monotonic() - began)

    def close(self) -> None:
        proc, self.python = self.python, None
        if proc is not None:
            proc.kill()
            proc.wait(10)


# ------------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def docs_server() -> Iterator[ApiServer]:
    model = model_dir()
    if model is None:
        pytest.skip("the default model is not prepared (run `make model` or set DSS_MODEL_DIR)")
    root = Path(tempfile.mkdtemp(prefix="dss-docs-test-"))
    server = ApiServer(
        model,
        root,
        dev=True,  # the README's X-DSS-User examples; keys (`dss-...`) are checked all the same
        env={
            "DSS_ENGINE__MAX_MODEL_LEN": "1024",
            "DSS_LIMITS__DEFAULT_MAX_TOKENS": "16",  # an example that forgot max_tokens stays quick
            # Room for the pinning example: a user may pin a quarter of the host tier (float32
            # pages of this model are 5.9 MB; the docs' session holds about ten by then).
            "DSS_STORE__HOST_CAPACITY_BYTES": str(1 << 30),
        },
    )
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def substitutions(server: ApiServer) -> list[tuple[str, str]]:
    """The documented address and data directory, replaced by the test server's (longest first)."""
    return [
        ("http://127.0.0.1:8000", server.base_url),
        ("127.0.0.1:8000", f"127.0.0.1:{server.port}"),
        ("localhost:8000", f"localhost:{server.port}"),
        ("~/.local/share/dss", str(server.data_dir)),
    ]


def _with_server(text: str, server: ApiServer) -> str:
    for old, new in substitutions(server):
        text = text.replace(old, new)
    return text


def _tail(text: str, n: int = 3000) -> str:
    return text if len(text) <= n else "…" + text[-n:]


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in DOC_FILES if doc_examples(p)])
def test_doc_examples_run(path: str, docs_server: ApiServer, tmp_path: Path) -> None:
    """Each example of `path`, in order, against the live server; every failure is reported."""
    env = dict(os.environ)
    env.pop("DSS_DATA_DIR", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("OPENAI_API_KEY", None)
    env.pop("OPENAI_BASE_URL", None)
    session = DocSession(tmp_path, env)
    failures: list[str] = []
    timings: list[str] = []
    try:
        for block in doc_examples(path):
            if "skip" in block.directives:
                timings.append(f"{block.where}: skipped ({block.directives['skip']})")
                continue
            code = _with_server(block.text, docs_server)
            if block.kind == "shell":
                outcome = session.run_shell(code)
            else:
                outcome = session.run_python(code, f"<{block.where}>")
            timings.append(f"{block.where}: {outcome.seconds:.1f} s")
            expected = block.directives.get("expect-error")
            if expected is None and not outcome.ok:
                failures.append(f"{block.where} failed:\n{code}\n--- output ---\n{_tail(outcome.output)}")
            elif expected is not None and (outcome.ok or expected not in outcome.output):
                failures.append(
                    f"{block.where} should fail with {expected!r}:\n{code}\n--- output ---\n"
                    f"{_tail(outcome.output)}"
                )
    finally:
        session.close()
    print("\n".join(timings))
    if failures:
        pytest.fail(
            f"{len(failures)} example(s) of {path} failed:\n\n"
            + "\n\n".join(failures)
            + f"\n\n--- server log ---\n{docs_server.log_tail(30)}",
            pytrace=False,
        )

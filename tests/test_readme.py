"""The README and docs/*.md run as written.

Every ```bash / ```python / ```toml / ```jsonl block carries a marker on the
line above it: ``<!-- readme: run by NAME -->`` where NAME is a test in this
file (or ``.ci/run``), or ``<!-- readme: illustration, REASON -->`` for a
block CI cannot run (a GPU, a Docker engine, a file you supply), with the
reason. The tests below run the blocks they name and compare what they print
with what the docs show; ``test_snippet_census`` counts both kinds per file.
"""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import uuid

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
CONFIG_DOC = ROOT / "docs" / "configuration.md"
SERVICE_DOC = ROOT / "docs" / "service.md"
MARKER = re.compile(r"<!-- readme: (run by (?P<test>[\w./:]+)|illustration, (?P<why>[^>]+\S)) -->")
CHECKED_LANGS = ("bash", "sh", "shell", "console", "python", "toml", "jsonl")


def blocks(path: pathlib.Path) -> list[tuple[str, str, str]]:
    """``(lang, marker line, body)`` of every fenced block of ``path``."""
    out = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while not lines[j].startswith("```"):
            j += 1
        out.append((m.group(1), lines[i - 1] if i else "", "\n".join(lines[i + 1:j]) + "\n"))
        i = j + 1
    return out


def block(path: pathlib.Path, test: str, lang: str, nth: int = 0) -> str:
    found = [b for lg, mk, b in blocks(path) if lg == lang and f"run by {test}" in mk]
    assert len(found) > nth, f"{path.name}: no {lang} block marked 'run by {test}'"
    return found[nth]


def shown_after(path: pathlib.Path, marker_block: str) -> str:
    """The plain ``` block that follows ``marker_block`` in ``path`` (its sample output)."""
    text = path.read_text()
    rest = text[text.index(marker_block) + len(marker_block):]
    rest = rest[rest.index("```") + 3:]  # past the block's own closing fence
    return re.search(r"^```\n(.*?)^```", rest, re.S | re.M).group(1)


def normalise(report: str) -> list[str]:
    """Replay output without what varies between machines: times and the L3 path."""
    out = []
    for line in report.splitlines():
        if line.startswith("done in") or line.startswith("report:") or line.startswith("plot:"):
            continue
        line = re.sub(r"\d+\.\d+s\b", "Ts", line)
        line = re.sub(r"L3 file://\S+", "L3 file://CACHE", line)
        line = re.sub(r"-{2,}", "--", line)  # column widths follow the times' widths
        out.append(" ".join(line.split()))
    return out


def run_py(code: str, cwd, env=None, timeout=300) -> str:
    script = pathlib.Path(cwd) / "block.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_every_code_block_is_run_or_marked_illustration(path):
    here = {name for name in globals() if name.startswith("test_")}
    for lang, mark, body in blocks(path):
        if lang not in CHECKED_LANGS:
            continue
        m = MARKER.search(mark)
        assert m, f"{path.name}: this {lang} block has no '<!-- readme: ... -->' marker above it:\n{body}"
        test = m.group("test")
        if test == ".ci/run":
            assert body.strip() in (ROOT / ".ci" / "run").read_text(), body
        elif test:
            assert test in here, f"{path.name}: the marker names {test!r}, which is not a test in {__file__}"


def test_readme_two_commands_print_what_the_readme_shows(tmp_path):
    cmd = block(README, "test_readme_two_commands_print_what_the_readme_shows", "bash")
    assert cmd.strip() == "bash scripts/setup.sh && .venv/bin/hicache replay"
    assert "bash scripts/setup.sh" in (ROOT / ".ci" / "run").read_text()  # CI runs the first half
    # The second half, on an empty per-user cache (a first run): same numbers, to the token.
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    env = {k: v for k, v in env.items() if not k.startswith("HICACHE_")}
    out = subprocess.run([sys.executable, "-m", "hicache.cli", "replay", "--quiet"], capture_output=True,
                         text=True, timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert normalise(out.stdout) == normalise(shown_after(README, cmd))
    assert f"L3 file://{tmp_path}/hicache/l3" in out.stdout


def test_readme_python_example_runs(tmp_path):
    example = block(README, "test_readme_python_example_runs", "python")
    out = run_py(example, tmp_path)
    assert "L1 hit: 96 identical logits: True" in out
    assert "L2 hit: 96 identical logits: True" in out


def test_readme_example_toml_asks_for_what_its_comments_say(tmp_path):
    toml = block(CONFIG_DOC, "test_readme_example_toml_asks_for_what_its_comments_say", "toml")
    path = tmp_path / "hicache.toml"
    path.write_text(toml)
    out = subprocess.run([sys.executable, "-m", "hicache.cli", "info", "--config", str(path)],
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")})
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    gib = {tier: info["pools"][tier]["bytes"] / 2**30 for tier in ("L1", "L2")}
    page_mib = info["layout"]["page_bytes"] / 2**20
    said = re.findall(r"= ([\d.]+) (MiB|GiB)", toml)
    assert [(float(v), u) for v, u in said] == [(page_mib, "MiB"), (gib["L1"], "GiB"), (gib["L2"], "GiB")], said


def _start_serve(env: dict) -> subprocess.Popen:
    serve = subprocess.Popen([sys.executable, "-m", "hicache.cli", "serve"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    started = serve.stdout.readline()  # the one line it prints once it listens
    if not started.startswith("hicache serve: REST"):
        serve.kill()
        raise AssertionError(started + serve.communicate(timeout=60)[1])
    assert f"engine socket {env['HICACHE_SERVICE__SOCKET_PATH']}," in started, started
    return serve


def _stop_serve(serve: subprocess.Popen) -> None:
    serve.send_signal(signal.SIGTERM)
    err = serve.communicate(timeout=60)[1]
    assert serve.returncode == 0, err


def test_readme_service_examples_run_twice_and_after_a_restart(tmp_path):
    """Both service examples, as a newcomer runs them: each twice in a row, the
    ServiceClient one after the service-mode one, then again after ``hicache
    serve`` restarts on the same file:// L3. They take the socket from the
    configuration (``service.socket_path``), as ``hicache serve`` does."""
    name = "test_readme_service_examples_run_twice_and_after_a_restart"
    service_mode, engine_client = block(SERVICE_DOC, name, "python", 0), block(SERVICE_DOC, name, "python", 1)
    for example in (service_mode, engine_client):
        assert "service.socket_path" in example and not re.findall(r"[\"'][^\"']*\.sock[\"']", example), example
    d = tempfile.mkdtemp(prefix="hc-")  # Unix socket paths are short
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    env.update(HICACHE_SERVICE__SOCKET_PATH=f"{d}/hicache.sock", HICACHE_SERVICE__PORT=str(port),
               HICACHE_STORAGE__URL=f"file://{tmp_path}/l3",
               HICACHE_SERVICE__SHM_NAME=f"hicache-readme-{uuid.uuid4().hex[:8]}", HICACHE_POOL__HOST_PAGES="32")
    hit = "engine B hit 80 tokens, 80 loaded from the shared segment; private L2 bytes: 0\n"
    first = "committed 4 new pages, 0 already cached; read back 4, identical: True\n"
    again = "committed 0 new pages, 4 already cached; read back 4, identical: True\n"
    serve = _start_serve(env)
    try:
        got = [run_py(ex, tmp_path, env=env) for ex in (service_mode, service_mode, engine_client, engine_client)]
    finally:
        _stop_serve(serve)
    assert got == [hit, hit, first, again]
    assert any((tmp_path / "l3").rglob("*")), "the service wrote no page to its file:// L3"
    serve = _start_serve(env)  # a fresh segment; the pages are in L3
    try:
        got = [run_py(ex, tmp_path, env=env) for ex in (service_mode, engine_client)]
    finally:
        _stop_serve(serve)
    assert got == [hit, first]


def test_trace_docs_example_replays_as_shown(tmp_path):
    doc = ROOT / "docs" / "traces.md"
    name = "test_trace_docs_example_replays_as_shown"
    (tmp_path / "trace.jsonl").write_text(block(doc, name, "jsonl"))
    cmd = block(doc, name, "bash").strip()
    assert cmd == ".venv/bin/hicache replay trace.jsonl --quiet --set storage.url=memory://"
    out = subprocess.run([sys.executable, "-m", "hicache.cli", *cmd.split()[1:]], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")})
    assert out.returncode == 0, out.stderr
    shown = normalise(shown_after(doc, block(doc, name, "bash")))
    assert normalise(out.stdout)[:len(shown)] == shown
    run_py(block(doc, name, "python"), tmp_path)  # it asserts its own round trip


def test_readme_documents_every_config_key():
    from hicache.core.config import HiCacheConfig
    text = CONFIG_DOC.read_text()

    def walk(prefix, obj):
        for k, v in obj.items():
            key = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict):
                yield from walk(key, v)
            else:
                yield key

    missing = [k for k in walk("", HiCacheConfig.load(env={}).model_dump()) if f"`{k}`" not in text]
    assert not missing, f"docs/configuration.md lacks {missing}"



def test_snippet_census(capsys):
    """How many blocks each page runs and how many it only shows, printed; every
    illustration says why CI cannot run it."""
    rows = []
    for path in [README, *DOCS]:
        marks = [MARKER.search(mk) for lg, mk, _ in blocks(path) if lg in CHECKED_LANGS]
        run = sum(1 for m in marks if m and m.group("test"))
        shown = [m.group("why") for m in marks if m and m.group("why")]
        assert all(len(w) >= 10 for w in shown), f"{path.name}: an illustration without its reason: {shown}"
        rows.append((path.relative_to(ROOT), run, len(shown)))
    with capsys.disabled():
        print(f"\nsnippets: {sum(r[1] for r in rows)} run, {sum(r[2] for r in rows)} illustrations; "
              + ", ".join(f"{p} {r}/{s}" for p, r, s in rows if r or s))
    assert sum(r[1] for r in rows) >= 9


def test_every_link_between_the_pages_resolves():
    """README and docs/ link each other by relative path and #anchor (GitHub's slugs)."""
    def slugs(path):
        out = set()
        for line in path.read_text().splitlines():
            if line.startswith("#"):
                s = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
                out.add(s)
        return out
    missing = []
    for path in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"\w+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                missing.append(f"{path.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
                missing.append(f"{path.name}: {target} (no such heading)")
    assert not missing, "\n".join(missing)


ENGINE_VENVS = {".venv-vllm": "vLLM", ".venv-sglang": "SGLang"}


@pytest.mark.slow
def test_engine_cpu_checks_pass():
    """The README's CPU check commands for vLLM and SGLang users, run as written from
    the checkout (each a few of the engine tests that read the README's own launch
    lines). A missing engine environment fails: CI builds it first. ~1-2 min on
    the 2-core box, most of it importing the engines."""
    cmds = [b for lg, mk, b in blocks(README) if lg == "bash" and "run by test_engine_cpu_checks_pass" in mk]
    assert len(cmds) == 2, cmds
    for cmd in cmds:
        venv = next(v for v in ENGINE_VENVS if f"{v}/bin/python" in cmd)
        if not (ROOT / venv / "bin" / "python").exists():
            pytest.fail(f"{venv} missing: run bash scripts/setup-engines.sh (the README's test command does)")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HICACHE_", "VLLM_", "HF_"))}
        out = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        tail = (out.stdout + out.stderr)[-4000:]
        assert out.returncode == 0, f"{ENGINE_VENVS[venv]} check exited {out.returncode}:\n{tail}"
        assert re.search(r"\d+ passed", tail) and "skipped" not in tail and "error" not in tail.lower(), tail


def test_service_rest_reference_curls_answer(tmp_path):
    """Every curl of docs/service.md's REST reference, against a live ``hicache serve``
    with an admin token: each answers 2xx, admin routes with the token only."""
    rows = [r for r in SERVICE_DOC.read_text().splitlines() if r.startswith("| ") and "`curl " in r]
    curls = [re.findall(r"`(curl [^`]+)`", r)[-1] for r in rows]
    assert len(curls) == 9, curls
    d = tempfile.mkdtemp(prefix="hc-")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "readme-" + uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    env.update(HICACHE_SERVICE__SOCKET_PATH=f"{d}/hicache.sock", HICACHE_SERVICE__PORT=str(port),
               HICACHE_STORAGE__URL="memory://", HICACHE_SERVICE__ADMIN_TOKEN=token,
               HICACHE_SERVICE__SHM_NAME=f"hicache-readme-{uuid.uuid4().hex[:8]}", HICACHE_POOL__HOST_PAGES="32")
    serve = _start_serve(env)
    try:
        shell = {**os.environ, "HC": f"http://127.0.0.1:{port}", "TOKEN": token}
        for cmd in curls:
            status = subprocess.run(["bash", "-c", cmd.replace("curl ", "curl -o /dev/null -w '%{http_code}' ", 1)],
                                    env=shell, capture_output=True, text=True, timeout=60)
            assert status.stdout.startswith("2"), (cmd, status.stdout, status.stderr)
            if "$TOKEN" in cmd:  # an admin route: refused without the token
                bare = cmd.replace(' -H "Authorization: Bearer $TOKEN"', "")
                status = subprocess.run(["bash", "-c", bare.replace("curl ", "curl -o /dev/null -w '%{http_code}' ", 1)],
                                        env=shell, capture_output=True, text=True, timeout=60)
                assert status.stdout == "401", (bare, status.stdout)
    finally:
        _stop_serve(serve)


def test_pd_docs_serve_lines():
    """docs/vllm-connector.md's P/D serve lines (producer, consumer) through vLLM's CLI parser,
    then a handoff between the two schedulers (tests/integrations/vllm_connector/test_pd.py)."""
    from tests.integrations.test_vllm_suites import _run
    _run(["tests/integrations/vllm_connector/test_pd.py::test_pd_docs_serve_lines"], ROOT, timeout=600)


def test_vllm_connector_serve_line():
    """docs/vllm-connector.md's ``vllm serve`` line through vLLM's own CLI parser, config and
    scheduler (tests/integrations/vllm_connector/test_docs_serve_line.py, inside .venv-vllm)."""
    from tests.integrations.test_vllm_suites import _run
    docs = block(ROOT / "docs" / "vllm-connector.md", "test_vllm_connector_serve_line", "bash")
    assert block(README, "test_vllm_connector_serve_line", "bash") == docs, "README and docs/vllm-connector.md show two serve lines"
    _run(["tests/integrations/vllm_connector/test_docs_serve_line.py"], ROOT, timeout=600)

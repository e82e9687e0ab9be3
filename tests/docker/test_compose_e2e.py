"""docker/compose.yaml on a real Docker engine: build, up, the example engine, faults.

Needs a Docker engine with the Compose v2 plugin (``docker info`` and
``docker compose version`` answer). Where none answers, every test here is
skipped with that reason, unless ``HC_DOCKER_E2E=require`` (set by
``scripts/docker-e2e.sh``), which turns the skip into a failure.

The stack runs as its own Compose project (``hicache-e2e-<pid>``) with its
own env file (a token, a free host port; ``HC_OFFLINE=1`` when
``docker/wheelhouse`` holds a torch wheel), so it never touches an
operator's ``docker/.env`` or running stack; it is taken down with its
volumes at the end. The fault tests run a small engine (``probe_engine.py``)
in the engine service's container and read what it saw, round by round.
"""
from __future__ import annotations

import ast
import json
import os
import re
import secrets
import shutil
import subprocess
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from hicache.core.config import HiCacheConfig
from hicache.core.hashing import HASH_BYTES
from hicache.storage.codec import ReadStatus, decode

from .test_compose import DOCKER, dotenv, free_port

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1800)]
PROBE = Path(__file__).with_name("probe_engine.py")
SOCKET = "/run/hicache/hicache.sock"


def _engine_missing() -> str | None:
    docker = shutil.which("docker")
    if docker is None:
        return "no `docker` command here"
    r = subprocess.run([docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"no Docker engine answers (`docker info`: {(r.stderr or r.stdout).strip()[-200:]})"
    r = subprocess.run([docker, "compose", "version"], capture_output=True, text=True)
    if r.returncode != 0:
        return "the Compose v2 plugin is missing (`docker compose version` fails)"
    return None


@dataclass
class Stack:
    project: str
    env_file: Path
    port: int
    token: str
    timings: dict[str, float] = field(default_factory=dict)
    helper_name: str = ""
    engine_exit: int = -1  # the example engine's exit code and log, kept when its container is removed
    engine_log: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self, *args: str) -> list[str]:
        return ["docker", "compose", "--project-directory", str(DOCKER), "-f", str(DOCKER / "compose.yaml"),
                "-p", self.project, "--env-file", str(self.env_file), *args]

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} exited {r.returncode}:\n{r.stderr[-3000:]}")
        return r

    def inspect(self, service: str) -> dict:
        cid = self.compose("ps", "-aq", service).stdout.split()
        assert len(cid) == 1, (service, cid)
        return json.loads(subprocess.run(["docker", "inspect", cid[0]], capture_output=True, text=True,
                                         check=True).stdout)[0]

    def health(self, service: str) -> str:
        return self.inspect(service)["State"].get("Health", {}).get("Status", "none")

    def wait(self, what: str, cond, timeout: float = 180, every: float = 1.0):
        deadline = time.monotonic() + timeout
        while not (v := cond()):
            assert time.monotonic() < deadline, f"{what}: not true after {timeout:.0f}s"
            time.sleep(every)
        return v

    def stats(self) -> dict:
        return httpx.get(self.url + "/v1/stats", timeout=10).json()

    def ready(self) -> int:
        try:
            return httpx.get(self.url + "/readyz", timeout=10).status_code
        except httpx.HTTPError:
            return 0

    def redis(self, *args: str) -> str:
        return self.compose("exec", "-T", "redis", "redis-cli", *args).stdout

    def helper(self) -> str:
        """A second engine container (the engine service's settings, idle), created once:
        on the vfs storage driver every new container copies the whole image."""
        if not self.helper_name:
            name = f"{self.project}-helper"
            self.compose("run", "-d", "--no-deps", "--name", name, "-v", f"{PROBE}:/probe.py:ro",
                         "--entrypoint", "sleep", "engine", "infinity", timeout=900)
            self.helper_name = name
        return self.helper_name

    def probe(self, seconds: int, first: int, mode: str) -> "Probe":
        p = subprocess.Popen(["docker", "exec", self.helper(), "python", "/probe.py", str(seconds), str(first),
                              mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return Probe(p)


class Probe:
    """``probe_engine.py`` running in an engine container; its rounds, as they arrive."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.rounds: list[dict] = []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.rounds.append(json.loads(line))

    def wait_round(self, stack: Stack, what: str, pred, after: int = 0, timeout: float = 120) -> int:
        """Index of the first round at or after ``after`` that satisfies ``pred``."""
        def find():
            assert self.proc.poll() is None or self._t.is_alive() or any(pred(r) for r in self.rounds[after:]), \
                f"probe exited {self.proc.returncode}: {self.proc.stderr.read()[-2000:] if self.proc.stderr else ''}"
            return next((i + 1 for i, r in enumerate(self.rounds[after:], after) if pred(r)), None)
        return stack.wait(f"probe: {what}", find, timeout, every=0.25) - 1

    def finish(self) -> int:
        self.proc.wait(timeout=180)
        self._t.join(10)
        return self.proc.returncode


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Stack:
    missing = _engine_missing()
    if missing:
        if os.environ.get("HC_DOCKER_E2E") == "require":
            pytest.fail(f"HC_DOCKER_E2E=require but {missing}")
        pytest.skip(f"{missing}; run `bash scripts/docker-e2e.sh` where one is up (results: bench/RESULTS.md)")
    env = dotenv(DOCKER / "hicache.env.example")
    st = Stack(project=f"hicache-e2e-{os.getpid()}", env_file=tmp_path_factory.mktemp("compose") / ".env",
               port=free_port(), token=secrets.token_urlsafe(24))
    env.update(HC_ADMIN_TOKEN=st.token, HC_PORT=str(st.port),
               HC_OFFLINE="1" if list((DOCKER / "wheelhouse").glob("torch-*.whl")) else "0")
    if os.environ.get("HC_CA_BUNDLE"):
        env["HC_CA_BUNDLE"] = os.environ["HC_CA_BUNDLE"]
    st.env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    try:
        t0 = time.monotonic()
        st.compose("build", "hicache", timeout=1800)
        st.timings["build_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        st.compose("up", "-d", timeout=600)
        st.wait("redis and hicache healthy", lambda: st.health("redis") == st.health("hicache") == "healthy")
        st.timings["up_healthy_s"] = time.monotonic() - t0
        st.wait("the engine exited", lambda: st.inspect("engine")["State"]["Status"] == "exited", timeout=600)
        st.timings["up_engine_done_s"] = time.monotonic() - t0
        st.engine_exit = st.inspect("engine")["State"]["ExitCode"]
        st.engine_log = st.compose("logs", "--no-color", "engine").stdout
        st.compose("rm", "-f", "engine")  # on vfs every container is a full copy of the image: free it
        yield st
    finally:
        logs = st.compose("logs", "--no-color", "--tail", "40", check=False).stdout
        if st.helper_name:
            subprocess.run(["docker", "rm", "-f", st.helper_name], capture_output=True, timeout=300)
        st.compose("down", "-v", "--remove-orphans", timeout=300, check=False)
        print(f"\ncompose e2e timings: {json.dumps({k: round(v, 1) for k, v in st.timings.items()})}")
        print(f"last log lines of the stack:\n{logs[-4000:]}")


def test_the_stack_comes_up_and_the_example_engine_replays_through_the_socket(stack):
    assert stack.health("redis") == "healthy" and stack.health("hicache") == "healthy"
    out = stack.engine_log
    assert stack.engine_exit == 0, out[-3000:]
    assert f"L3 hicache+unix://{SOCKET}" in out, out[-3000:]
    st = stack.stats()
    assert st["engine"]["clients_total"] >= 1 and st["tiers"]["L2"]["bytes_written"] > 0
    assert not st["tiers"]["L3"]["down"]


def test_the_engines_pages_reach_redis(stack):
    st = stack.wait("the L3 writer drained", lambda: (s := stack.stats())["tiers"]["L3"]["service"]["queue_pages"]
                    == 0 and s["tiers"]["L3"]["service"]["written"] > 0 and s)
    wb = st["tiers"]["L3"]["service"]
    assert wb["failed"] == 0 and wb["written"] > 0
    fp = st["fingerprint"]
    prefix = f"hicache:{fp[:8]}:".encode()
    # Keys are binary (prefix + 16-byte page hash): redis-cli --no-raw quotes them with
    # C escapes, which read back as Python bytes literals and go back in through stdin.
    keys = [ast.literal_eval("b" + ln) for ln in stack.redis("--no-raw", "--scan").splitlines() if ln]
    assert keys and all(k.startswith(prefix) and len(k) == len(prefix) + HASH_BYTES for k in keys), keys[:3]
    assert len(keys) >= wb["written"] - wb["stale"] > 0
    # Objects read straight from Redis carry this layout's fingerprint and verify.
    layout = HiCacheConfig.load(env={"HICACHE_MODEL__MODEL_ID": "hicache-demo-tiny"}).layout()
    assert layout.fingerprint() == fp
    for key in keys[:3]:
        arg = "".join(f"\\x{b:02x}" for b in key)
        out = subprocess.run(stack.argv("exec", "-T", "redis", "redis-cli", "--no-raw"), input=f'GET "{arg}"\n',
                             capture_output=True, text=True, timeout=60, check=True).stdout.strip()
        got = decode(ast.literal_eval("b" + out), key[len(prefix):], fp, [p.page_bytes for p in layout.planes])
        assert got.status is ReadStatus.OK, (key, got)


def test_rest_answers_on_loopback_and_admin_routes_need_the_token(stack):
    with httpx.Client(base_url=stack.url, timeout=10) as c:
        assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code == 200
        assert c.get("/v1/stats").json()["tiers"]["L2"]["capacity_pages"] == 4096
        m = c.get("/metrics").text
        assert 'hicache_up{tier="L3"} 1.0' in m and "hicache_l3_writeback_pages_total" in m
        assert stack.token not in c.get("/v1/config").text
        assert c.post("/v1/flush", json={"tier": "L2"}).status_code == 401
        bad = c.post("/v1/flush", json={"tier": "L2"}, headers={"Authorization": "Bearer not-the-token"})
        assert bad.status_code == 401
        ok = c.post("/v1/flush", json={"tier": "L2"}, headers={"Authorization": f"Bearer {stack.token}"})
        assert ok.status_code == 200, ok.text


def test_an_engine_with_another_layout_fails_fast_naming_the_fields(stack):
    r = subprocess.run(["docker", "exec", "-e", "HICACHE_MODEL__NUM_LAYERS=8", stack.helper(), "hicache", "replay",
                        "--service", SOCKET, "--quiet"], capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "num_layers" in out and "8" in out and "4" in out, out[-3000:]


def test_restarting_hicache_costs_misses_then_the_engine_recovers_from_redis(stack):
    probe = stack.probe(seconds=240, first=10_000, mode="fixed")
    try:
        probe.wait_round(stack, "all 8 pages read back", lambda r: r["hits"] == 8)
        stack.wait("the probe's pages written to Redis",
                   lambda: stack.stats()["tiers"]["L3"]["service"]["queue_pages"] == 0, every=0.5)
        n = len(probe.rounds)
        stack.compose("restart", "hicache")
        miss = probe.wait_round(stack, "a miss while hicache restarts", lambda r: r["hits"] < 8, after=n)
        back = probe.wait_round(stack, "all 8 pages again, loaded from Redis", lambda r: r["hits"] == 8,
                                after=miss + 1, timeout=240)
    finally:
        probe.proc.terminate()
        probe.finish()
    assert all(r["wrong"] == 0 for r in probe.rounds), probe.rounds
    assert probe.rounds[back]["stored"] == 0  # stored in round 0 only: these came back through the service
    stack.wait("hicache healthy again", lambda: stack.health("hicache") == "healthy")
    for svc in ("redis", "hicache"):
        assert stack.inspect(svc)["RestartCount"] == 0, svc  # no crash loop


def test_with_redis_stopped_readyz_fails_and_the_engine_keeps_working_on_l2(stack):
    probe = stack.probe(seconds=240, first=50_000, mode="fresh")
    try:
        probe.wait_round(stack, "pages read back", lambda r: r["hits"] == 8)
        stack.compose("stop", "redis")
        stack.wait("/readyz answers 503", lambda: stack.ready() == 503, every=0.5)
        assert stack.stats()["tiers"]["L3"]["down"]
        failed = stack.wait("writes to Redis fail", lambda: stack.stats()["tiers"]["L3"]["service"]["failed"],
                            every=0.5)
        n = len(probe.rounds)
        probe.wait_round(stack, "new pages stored and read back with Redis down",
                         lambda r: r["stored"] == 8 and r["hits"] == 8, after=n)
        stack.compose("start", "redis")
        stack.wait("/readyz answers 200 again", lambda: stack.ready() == 200)
        written = stack.stats()["tiers"]["L3"]["service"]["written"]
        stack.wait("new pages reach Redis again",
                   lambda: stack.stats()["tiers"]["L3"]["service"]["written"] > written, every=0.5)
    finally:
        probe.proc.terminate()
        probe.finish()
    assert all(r["wrong"] == 0 for r in probe.rounds)
    assert stack.stats()["tiers"]["L3"]["service"]["failed"] >= failed > 0
    stack.wait("hicache healthy again", lambda: stack.health("hicache") == "healthy", timeout=120)
    assert stack.inspect("redis")["RestartCount"] == 0 and stack.inspect("hicache")["RestartCount"] == 0


def test_sigkill_of_hicache_then_up_adopts_the_l2_and_does_not_rerun_the_engine(stack):
    """A crash (SIGKILL) leaves the segment in the hicache-shm tmpfs, which shm-holder keeps
    mounted; `up -d hicache` starts a service that adopts it, pages included. The README's
    command after a crash starts hicache only: the exited example engine stays as it was."""
    probe = stack.probe(seconds=240, first=90_000, mode="fixed")
    try:
        probe.wait_round(stack, "all 8 pages read back", lambda r: r["hits"] == 8)
    finally:
        probe.proc.terminate()
        probe.finish()
    # The probe's 8 pages, asked of L2 alone (no L3 round trip, nothing loaded).
    query = {"tokens": list(range(90_000, 90_000 + 8 * stack.stats()["page_size"])), "include_l3": False}
    assert httpx.post(stack.url + "/v1/lookup", json=query, timeout=10).json()["L2"]["pages"] == 8
    used = stack.stats()["tiers"]["L2"]["used_pages"]
    def engines_running() -> list[str]:
        return stack.compose("ps", "-q", "engine").stdout.split()  # running containers only
    assert not engines_running()  # the example engine exited (its container may be gone)
    # The probe's idle container mounts the tmpfs too: remove it, so that only shm-holder
    # keeps it mounted while hicache is dead (the example engine has exited already).
    subprocess.run(["docker", "rm", "-f", stack.helper()], capture_output=True, timeout=300, check=True)
    stack.helper_name = ""
    holders = subprocess.run(["docker", "ps", "--filter", f"volume={stack.project}_hicache-shm", "--format",
                              "{{.Label \"com.docker.compose.service\"}}"], capture_output=True, text=True,
                             check=True).stdout.split()
    assert sorted(holders) == ["hicache", "shm-holder"], holders
    stack.compose("kill", "-s", "SIGKILL", "hicache")
    stack.wait("hicache down", lambda: stack.ready() == 0, every=0.5)
    stack.compose("up", "-d", "hicache", timeout=600)
    stack.wait("hicache healthy again", lambda: stack.health("hicache") == "healthy", timeout=240)
    after = stack.stats()
    assert after["engine"]["segment_origin"] == "adopted", after["engine"]
    assert after["tiers"]["L2"]["used_pages"] >= used >= 8, (used, after["tiers"]["L2"])
    assert httpx.post(stack.url + "/v1/lookup", json=query, timeout=10).json()["L2"]["pages"] == 8
    assert not engines_running()  # `up -d hicache` neither re-created nor re-ran the example engine


def test_a_crash_of_hicache_is_restarted_and_adopts_its_l2_but_docker_kill_is_a_stop(stack):
    """``restart: unless-stopped`` restarts a crash, not a kill. ``docker compose kill``
    (any signal) is a manual stop to Docker: hicache stays down until ``up -d hicache``.
    A crash (the process dies on its own; here SIGKILL sent from the host to the
    container's process, as the kernel's OOM killer would) is restarted by the policy,
    and the new service adopts the segment, pages included."""
    if stack.helper_name:  # only shm-holder may keep the tmpfs mounted while hicache is down
        subprocess.run(["docker", "rm", "-f", stack.helper_name], capture_output=True, timeout=300, check=True)
        stack.helper_name = ""
    stack.wait("hicache healthy", lambda: stack.health("hicache") == "healthy", timeout=240)
    used = stack.wait("pages in L2", lambda: stack.stats()["tiers"]["L2"]["used_pages"])
    restarts = stack.inspect("hicache")["RestartCount"]
    stack.compose("kill", "-s", "SIGKILL", "hicache")
    stack.wait("hicache down", lambda: stack.inspect("hicache")["State"]["Status"] == "exited", every=0.5)
    time.sleep(15)  # the policy's first restart comes within a second or two: none comes
    st = stack.inspect("hicache")
    assert st["State"]["Status"] == "exited" and st["RestartCount"] == restarts, st["State"]
    stack.compose("up", "-d", "hicache", timeout=600)
    stack.wait("hicache healthy after up", lambda: stack.health("hicache") == "healthy", timeout=240)
    restarts = stack.inspect("hicache")["RestartCount"]
    pid = stack.inspect("hicache")["State"]["Pid"]
    assert pid > 0
    os.kill(pid, 9)  # from the host: to Docker the container's process died by itself
    stack.wait("the policy restarted hicache", lambda: stack.inspect("hicache")["RestartCount"] == restarts + 1,
               timeout=120, every=0.5)
    stack.wait("hicache healthy after the crash", lambda: stack.health("hicache") == "healthy", timeout=240)
    after = stack.stats()
    assert after["engine"]["segment_origin"] == "adopted", after["engine"]
    assert after["tiers"]["L2"]["used_pages"] >= used > 0, (used, after["tiers"]["L2"])


def _certs(text: str) -> set[str]:
    return set(re.findall(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", text, re.S))


def test_image_layers_hold_no_ca_bundle_and_no_wheel(stack):
    """The build's secret and wheelhouse are mounts, never layer content.

    Needles: the certificates of the CA bundle (``HC_CA_BUNDLE``, else the
    system one) that the image's own bundle lacks, i.e. the proxy's; every
    layer file under 8 MiB is searched for them, and no layer may hold a
    wheel of ``docker/wheelhouse`` or a file under ``run/secrets`` (BuildKit
    leaves the empty mount point).
    """
    bundle = Path(os.environ.get("HC_CA_BUNDLE") or "/etc/ssl/certs/ca-certificates.crt")
    assert bundle.is_file(), f"no CA bundle at {bundle} to look for; set HC_CA_BUNDLE"
    history = subprocess.run(["docker", "history", "--no-trunc", "--format", "{{.CreatedBy}}", "hicache:cpu"],
                             capture_output=True, text=True, check=True).stdout
    assert "BEGIN CERTIFICATE" not in history and stack.token not in history
    proc = subprocess.Popen(["docker", "save", "hicache:cpu"], stdout=subprocess.PIPE)
    image_certs: set[str] = set()
    texts: list[bytes] = []
    names: list[str] = []
    with tarfile.open(fileobj=proc.stdout, mode="r|") as outer:
        for m in outer:
            if not m.name.endswith("layer.tar"):
                continue
            with tarfile.open(fileobj=outer.extractfile(m), mode="r|") as layer:
                for f in layer:
                    name = f.name.removeprefix("./")  # an imported rootfs tarball names ./etc/...
                    names.append(name)
                    if f.isfile() and f.size < 8 << 20:
                        data = layer.extractfile(f).read()
                        if b"BEGIN CERTIFICATE" in data:
                            texts.append(data)
                            if name == "etc/ssl/certs/ca-certificates.crt":
                                image_certs |= _certs(data.decode())
    assert proc.wait() == 0
    assert image_certs, "the image's own CA bundle was not found in its layers"
    foreign = _certs(bundle.read_text()) - image_certs
    for cert in foreign:
        body = cert.splitlines()[1].encode()
        assert not any(body in t for t in texts), f"a certificate of {bundle} is in a layer"
    ours = {w.name for w in (DOCKER / "wheelhouse").glob("*.whl")}
    assert not [n for n in names if n.rsplit("/", 1)[-1] in ours or n.startswith("run/secrets/")]
    print(f"\nlayers: {len(names)} files; {len(foreign)} certificate(s) of {bundle} the image lacks: in no layer")

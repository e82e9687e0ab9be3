"""docker/compose.yaml and docker/Dockerfile, checked without a Docker engine.

Every command a container runs (service commands and health checks) is run
here too, with the arguments and environment the container would get: the
Dockerfile's ENV, then the service's ``environment`` (values interpolated the
way Compose does, from ``hicache.env.example`` as the ``.env``). Only what
must differ on a CI box is rewritten, and only these:

* the Redis host ``redis:6379`` -> the ``redis_url`` fixture's server;
* ``0.0.0.0`` -> ``127.0.0.1`` (tests never listen beyond loopback; the admin
  token is still required because one is configured);
* container port 8177 / Redis 6379 -> free local ports; ``--dir /data`` -> a tmp dir;
* ``/run/hicache`` (socket volume) and ``/run/secrets/admin_token`` -> tmp paths;
* the shared-memory name -> a unique one, so parallel runs do not collide;
* the image's ``hicache`` entrypoint -> ``python -m hicache.cli``.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from hicache.cli import build_parser
from hicache.core.config import HiCacheConfig

DOCKER = Path(__file__).resolve().parents[2] / "docker"
TOKEN = "compose-test-token"


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dotenv(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def interpolate(value, env: dict[str, str]):
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``$$`` on every string."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        v = env.get(name)
        if op == ":-":
            return v if v else default
        if op == "-":
            return default if v is None else v
        assert v is not None, f"${{{name}}} is unset and has no default"
        return v
    return re.sub(r"\$\$|\$\{(\w+)(?:(:?-)([^}]*))?\}", sub, value)


def user_env() -> dict[str, str]:
    """What an operator's docker/.env holds: the example with the token filled in."""
    env = dotenv(DOCKER / "hicache.env.example")
    env["HC_ADMIN_TOKEN"] = TOKEN
    return env


@pytest.fixture(scope="module")
def compose() -> dict:
    return interpolate(yaml.safe_load((DOCKER / "compose.yaml").read_text()), user_env())


def dockerfile_env() -> dict[str, str]:
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())
    env: dict[str, str] = {}
    stage = []
    for line in text.splitlines():
        if line.startswith("FROM "):
            stage = []
        if line.startswith("ENV "):
            stage += shlex.split(line[4:])
    for item in stage:  # the final stage's ENV
        k, _, v = item.partition("=")
        env[k] = v.replace("$PATH", os.environ["PATH"])
    return env


def dockerfile_entrypoint() -> list[str]:
    m = re.search(r"^ENTRYPOINT (\[.*\])$", (DOCKER / "Dockerfile").read_text(), re.M)
    return yaml.safe_load(m.group(1))


def local_argv(argv: list[str]) -> list[str]:
    assert argv[0] == "hicache", argv
    return [sys.executable, "-m", "hicache.cli", *argv[1:]]


def container_env(svc: dict, rewrites: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    env.update({k: v for k, v in dockerfile_env().items() if k.startswith("HICACHE_")})
    env.update({k: str(v) for k, v in svc.get("environment", {}).items()})
    for k, v in list(env.items()):
        if k.startswith("HICACHE_"):
            for old, new in rewrites.items():
                v = v.replace(old, new)
            env[k] = v
    return env


# ----------------------------------------------------------------- static checks
def test_compose_refers_only_to_files_that_exist(compose):
    for name, svc in compose["services"].items():
        if "build" in svc:
            ctx = (DOCKER / svc["build"]["context"]).resolve()
            assert (ctx / svc["build"]["dockerfile"]).is_file(), name
            for d in ("hicache", "api", "kernels", "pyproject.toml", "README.md"):
                assert (ctx / d).exists(), d  # what the Dockerfile installs
        for ef in svc.get("env_file", []):
            if isinstance(ef, dict) and ef.get("required") is False:
                continue
            assert (DOCKER / (ef["path"] if isinstance(ef, dict) else ef)).is_file(), (name, ef)
    for name, sec in compose.get("secrets", {}).items():
        assert "file" not in sec or (DOCKER / sec["file"]).exists(), name


def test_build_context_keeps_what_the_dockerfile_reads():
    """``.dockerignore`` is an allow-list: what the build mounts must be on it, and what
    ``pip install /src`` of the whole context needs."""
    text = (DOCKER / "Dockerfile").read_text()
    sources = set(re.findall(r"--mount=type=bind,source=([^,\s]+)", text))
    assert "--mount=type=bind,target=/src,rw" in text  # the whole (allow-listed) context
    allowed = {ln[1:].rstrip("/") for ln in (DOCKER.parent / ".dockerignore").read_text().splitlines()
               if ln.startswith("!")}
    assert sources == {"docker/wheelhouse", "docker/pip-sources.sh", "pyproject.toml"}
    assert sources | {"README.md", "hicache", "api", "kernels"} <= allowed, sources - allowed
    assert (DOCKER / "wheelhouse").is_dir()  # bind-mounted even when empty


def test_build_takes_the_ca_bundle_as_a_secret_and_offline_as_an_argument(compose):
    build = compose["services"]["hicache"]["build"]
    assert build["secrets"] == ["ca"] and build["args"]["OFFLINE"] == "0"
    assert compose["secrets"]["ca"] == {"file": "/dev/null"}  # HC_CA_BUNDLE unset: an empty secret
    text = (DOCKER / "Dockerfile").read_text()
    assert text.count("--mount=type=secret,id=ca") == 3  # every pip step
    assert "PIP_CERT=/run/secrets/ca" in (DOCKER / "pip-sources.sh").read_text()


def test_compose_deployment_contract(compose):
    s = compose["services"]
    assert s["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    hc = s["hicache"]
    assert hc["environment"]["HICACHE_STORAGE__URL"] == "redis://redis:6379/0"
    assert hc["environment"]["HICACHE_SERVICE__HOST"] == "0.0.0.0"
    assert hc["ports"] == ["127.0.0.1:8177:8177"]
    shm = compose["volumes"]["hicache-shm"]["driver_opts"]
    assert shm == {"type": "tmpfs", "device": "tmpfs", "o": "size=2g"}  # from HC_SHM_SIZE
    assert "hicache-run:/run/hicache" in hc["volumes"] and "hicache-run:/run/hicache" in s["engine"]["volumes"]
    assert "hicache-shm:/dev/shm" in hc["volumes"] and "hicache-shm:/dev/shm" in s["engine"]["volumes"]
    assert "ipc" not in hc and "ipc" not in s["engine"]  # a restarted hicache would strand joined engines
    # The tmpfs stays mounted (so a killed hicache adopts its segment) while shm-holder runs.
    holder = s["shm-holder"]
    assert holder["volumes"] == ["hicache-shm:/dev/shm"] and holder["restart"] == "unless-stopped"
    assert hc["depends_on"]["shm-holder"]["condition"] == "service_started"
    assert s["engine"]["command"][:3] == ["replay", "--service", hc["environment"]["HICACHE_SERVICE__SOCKET_PATH"]]
    for name in ("redis", "hicache"):
        assert s[name]["restart"] == "unless-stopped" and "healthcheck" in s[name]
    assert s["hicache"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert s["engine"]["depends_on"]["hicache"]["condition"] == "service_healthy"
    # The token is a secret from the environment, never a plain variable or a layer of the image.
    assert hc["secrets"] == ["admin_token"] and compose["secrets"]["admin_token"] == {"environment": "HC_ADMIN_TOKEN"}
    assert not any("ADMIN_TOKEN" in k and "FILE" not in k for k in hc["environment"])
    assert "ADMIN_TOKEN" not in (DOCKER / "Dockerfile").read_text().replace("ADMIN_TOKEN_FILE", "")
    assert not re.search(r"HC_ADMIN_TOKEN=\S", (DOCKER / "hicache.env.example").read_text())
    assert dockerfile_entrypoint() == ["hicache"]


def test_compose_variables_stay_out_of_the_settings_namespace():
    """``docker/.env`` names may be exported in a shell: none may be read as a hicache setting."""
    used = set(re.findall(r"\$\{(\w+)", (DOCKER / "compose.yaml").read_text()))
    used |= {v["environment"] for v in yaml.safe_load((DOCKER / "compose.yaml").read_text())["secrets"].values()
             if "environment" in v}
    assert used and not [n for n in used if n.startswith("HICACHE_")], used
    env = user_env()
    assert set(env) <= used, set(env) - used  # the example documents only variables compose reads
    # Exported in the shell, they leave every local command working.
    cfg = HiCacheConfig.load(env={**env, "HC_STORAGE_URL": "redis://x:1/0"})
    assert cfg == HiCacheConfig.load(env={})


def test_docker_env_is_git_ignored():
    root = DOCKER.parent
    if not (root / ".git").exists():
        pytest.fail(f"{root} is not a git checkout; this test reads its .gitignore through git")
    for path in ("docker/.env", "docker/hicache.env", "docker/wheelhouse/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"):
        r = subprocess.run(["git", "check-ignore", "-q", path], cwd=root)
        assert r.returncode == 0, f"{path} is not git-ignored"


def test_docker_compose_config_passes():
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("the docker compose plugin is not installed here (`docker compose version` fails)")
    r = subprocess.run([docker, "compose", "-f", str(DOCKER / "compose.yaml"), "config", "--quiet"],
                       capture_output=True, text=True, env={**os.environ, **user_env()}, cwd=DOCKER)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------- the containers' commands, run here
def test_shm_holder_waits_until_told_to_stop_then_exits_at_once(compose):
    """Its shell is PID 1 in its container, which ignores a TERM it has no trap for
    (``docker compose down`` would wait 10 s and kill it): it traps TERM and exits 0."""
    argv = [a.replace("$$", "$") for a in compose["services"]["shm-holder"]["entrypoint"]]  # compose's escape
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(1.0)  # still holding
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()


def test_redis_container_command_and_healthcheck(compose, tmp_path):
    svc = compose["services"]["redis"]
    port = free_port()
    argv = [*svc["command"], "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD"
        deadline = time.monotonic() + 10
        while True:
            r = subprocess.run([test[1], "-p", str(port), *test[2:]], capture_output=True, text=True)
            if r.stdout.strip() == "PONG":
                break
            assert time.monotonic() < deadline, r
            time.sleep(0.1)
        c = redis.Redis(port=port)
        assert c.config_get("save") == {"save": ""} and c.config_get("appendonly") == {"appendonly": "no"}
        assert c.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        assert int(c.config_get("maxmemory")["maxmemory"]) == 4 << 30
        assert c.config_get("protected-mode") == {"protected-mode": "no"}
        assert "ports" not in svc  # which is why protected mode can be off
    finally:
        proc.terminate()
        proc.wait(10)


def test_hicache_and_engine_container_commands_against_real_redis(compose, redis_url):
    s = compose["services"]
    d = tempfile.mkdtemp(prefix="hc-")
    secret = Path(d) / "admin_token"
    secret.write_text(user_env()["HC_ADMIN_TOKEN"])  # what Compose mounts from the environment
    port = free_port()
    host_port = redis_url.split("//", 1)[1].split("/", 1)[0]
    rewrites = {"redis:6379": host_port, "0.0.0.0": "127.0.0.1", "8177": str(port),
                "/run/hicache": d, "/run/secrets/admin_token": str(secret),
                "hicache-l2": f"hicache-compose-{uuid.uuid4().hex[:8]}"}
    env = container_env(s["hicache"], rewrites)
    assert env["HICACHE_STORAGE__URL"] == redis_url.rsplit("/", 1)[0] + "/0"
    serve = subprocess.Popen(local_argv([*dockerfile_entrypoint(), *s["hicache"]["command"]]), env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        check = [a.replace("8177", str(port)) for a in s["hicache"]["healthcheck"]["test"][1:]]
        assert check[0] == "python"
        deadline = time.monotonic() + 60
        while subprocess.run([sys.executable, *check[1:]], capture_output=True).returncode != 0:
            assert serve.poll() is None, serve.communicate()
            assert time.monotonic() < deadline, "health check never passed"
            time.sleep(0.2)
        base = f"http://127.0.0.1:{port}"
        assert httpx.post(base + "/v1/flush", json={"tier": "L2"}).status_code == 401
        ok = httpx.post(base + "/v1/flush", json={"tier": "L2"}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200
        st = httpx.get(base + "/v1/stats").json()
        assert st["tiers"]["L3"]["configured"] and not st["tiers"]["L3"]["down"]
        assert st["tiers"]["L2"]["capacity_pages"] == 4096

        eng = s["engine"]
        argv = [*eng["entrypoint"], *eng["command"]]
        build_parser().parse_args([a.replace("/run/hicache", d) for a in argv[1:]])
        r = subprocess.run(local_argv([a.replace("/run/hicache", d) for a in argv]),
                           env=container_env(eng, rewrites), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"L3 hicache+unix://{d}/hicache.sock" in r.stdout, r.stdout
        st = httpx.get(base + "/v1/stats").json()
        assert st["engine"]["clients_total"] >= 1
        assert st["tiers"]["L2"]["bytes_written"] > 0  # the engine stored its pages in the service
        # ... which wrote them behind to Redis.
        deadline = time.monotonic() + 30
        while (l3 := httpx.get(base + "/v1/stats").json()["tiers"]["L3"]["service"])["written"] == 0:
            assert time.monotonic() < deadline, l3
            time.sleep(0.1)
        assert l3["failed"] == 0
    finally:
        serve.terminate()
        out, err = serve.communicate(timeout=30)
        shutil.rmtree(d, ignore_errors=True)
    assert serve.returncode == 0, err

"""One distribution, three import names: hicache, hicache.kernels (kernels/),
hicache.api (api/), from a wheel and from the source tree."""
import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_source_tree_maps_kernels_and_api():
    import hicache.api
    import hicache.kernels
    assert pathlib.Path(hicache.kernels.__file__).parent.name == "kernels"
    assert pathlib.Path(hicache.api.__file__).parent.name == "api"
    assert hasattr(hicache.kernels, "copy_pages")


def test_wheel_contains_and_imports_all_three(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = next(tmp_path.glob("hicache-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("hicache/__init__.py", "hicache/kernels/__init__.py", "hicache/kernels/page_copy.py",
              "hicache/api/__init__.py", "hicache/api/app.py", "hicache/storage/__init__.py",
              "hicache/engine/model.py"):
        assert f in names, f
    assert any(n.endswith("entry_points.txt") for n in names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    code = ("import hicache, hicache.kernels, hicache.api, hicache.storage;"
            "print(hicache.__file__); print(hicache.kernels.__file__); print(hicache.api.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert all(str(site) in line for line in out.stdout.split()), out.stdout


def test_core_imports_without_service_dependencies(tmp_path):
    """The core library must import where FastAPI/uvicorn/redis are absent (the GPU machine)."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('fastapi', 'uvicorn', 'starlette', 'redis', 'prometheus_client'):\n"
        "            raise ImportError(f'blocked {name}')\n"
        "sys.meta_path.insert(0, _Block())\n")
    code = ("import hicache, hicache.kernels, hicache.hicache, hicache.engine.replay;"
            "from hicache.storage import open_storage; open_storage('memory://', fingerprint='0'*32);"
            "print('ok')")
    import os
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_cpu_runtime_needs_no_triton(tmp_path):
    """A CPU-only install has no Triton (only the dev extra brings it, for the
    interpreter tests): embedded use, replay and page copies run without it,
    and asking for the Triton backend says what is missing."""
    import os
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'triton':\n"
        "            raise ImportError(f'blocked {name}')\n"
        "sys.meta_path.insert(0, _Block())\n")
    code = """
import sys, torch
from hicache.cli import main
from hicache.kernels import copy_pages
from hicache.pools import DevicePool, HostPool
from hicache.config import HiCacheConfig
layout = HiCacheConfig.load(env={}).layout()
dev, host = DevicePool(layout, 4, device="cpu"), HostPool(layout, 4)
for b in dev.buffers:
    b.copy_(torch.randn(b.shape))
copy_pages(dev, host, [2, 0], [1, 3])
assert all(torch.equal(dev.page_view(2)[k], host.page_view(1)[k]) for k in dev.page_view(2))
try:
    copy_pages(dev, host, [1], [0], backend="triton")
except RuntimeError as e:
    print("triton backend:", e)
rc = main(["replay", "--quiet", "--scale", "tiny", "--no-baselines", "--set", "storage.url=memory://"])
print("replay rc", rc, "triton imported", "triton" in sys.modules)
"""
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "replay rc 0 triton imported False" in out.stdout, out.stdout
    assert "triton backend: backend='triton' needs the triton package" in out.stdout

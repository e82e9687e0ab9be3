"""``import hicache`` installs a meta-path finder; it must work in a bare interpreter, where
nothing imported ``importlib.util`` before it (an installed image: ``python -c "import
hicache.api.serve"`` in docker/Dockerfile hit RecursionError there)."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_import_in_a_bare_interpreter_does_not_recurse(tmp_path):
    code = ("import sys; sys.path[:0] = [sys.argv[1], *sys.argv[2:]]; assert 'importlib.util' not in sys.modules; "
            "import hicache, hicache.core.config, hicache.api.serve, hicache.kernels; print('ok')")
    site = [p for p in sys.path if p.endswith("site-packages")]
    out = subprocess.run([sys.executable, "-S", "-c", code, str(ROOT), *site], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

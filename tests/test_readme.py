"""The README's Python example runs as written, and its two commands are the
ones .ci/run and scripts/setup.sh implement."""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_python_example_runs(tmp_path):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    example = next(b for b in blocks if "HiCache(" in b and "prefill(" in b)
    script = tmp_path / "example.py"
    script.write_text(example)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "L1 hit: 96 identical logits: True" in out.stdout
    assert "L2 hit: 96 identical logits: True" in out.stdout


def test_readme_commands_match_ci():
    text = (ROOT / "README.md").read_text()
    assert "bash scripts/setup.sh && .venv/bin/hicache replay" in text
    assert ".venv/bin/python -m pytest" in text
    assert ".venv/bin/python -m pytest" in (ROOT / ".ci" / "run").read_text()


def test_readme_documents_every_config_key():
    from hicache.config import HiCacheConfig
    text = (ROOT / "README.md").read_text()

    def walk(prefix, obj):
        for k, v in obj.items():
            key = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict):
                yield from walk(key, v)
            else:
                yield key

    missing = [k for k in walk("", HiCacheConfig.load(env={}).model_dump()) if f"`{k}`" not in text]
    assert not missing, f"README configuration reference lacks {missing}"

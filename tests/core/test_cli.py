"""The command line: help, info and argument errors stay light (no torch),
help reads as plain text, and --config/--set work on either side of the
subcommand."""
import json
import subprocess
import sys

import pytest

from hicache.cli import main

NO_TORCH = """
import sys
from hicache.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
print("torch imported:", "torch" in sys.modules, "triton imported:", "triton" in sys.modules, "rc:", rc)
"""


@pytest.mark.parametrize("argv,rc", [(["--help"], 0), (["info"], 0), ([], 0), (["serve", "--help"], 0),
                                     (["replay", "--help"], 0), (["bogus"], 2), (["info", "--nope"], 2),
                                     (["info", "--set", "pool.host_pages=x"], 2)])
def test_help_info_and_argument_errors_do_not_import_torch(argv, rc):
    out = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True, text=True, timeout=120)
    assert f"torch imported: False triton imported: False rc: {rc}" in out.stdout, out.stdout + out.stderr


def test_help_is_plain_text_and_serve_help_describes_its_settings(capsys):
    for argv in (["--help"], ["serve", "--help"], ["replay", "--help"], ["info", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = capsys.readouterr().out
        assert "``" not in text and ":class:" not in text, argv
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for key in ("service.host", "service.port", "service.socket_path", "pool.host_pages", "storage.url",
                "Ctrl-C"):
        assert key in text, key


def _info(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_config_options_before_or_after_the_subcommand(capsys, tmp_path):
    assert _info(capsys, ["--set", "pool.device_pages=32", "info"])["pools"]["L1"]["pages"] == 32
    assert _info(capsys, ["--set", "pool.device_pages=32"])["pools"]["L1"]["pages"] == 32  # info is the default
    # both sides: after the subcommand wins, as it is read last
    both = _info(capsys, ["--set", "pool.device_pages=32", "--set", "pool.host_pages=8", "info",
                          "--set", "pool.device_pages=40"])
    assert (both["pools"]["L1"]["pages"], both["pools"]["L2"]["pages"]) == (40, 8)
    toml = tmp_path / "h.toml"
    toml.write_text("[pool]\nhost_pages = 24\n")
    assert _info(capsys, ["--config", str(toml), "info"])["pools"]["L2"]["pages"] == 24


def test_info_matches_the_pools_without_building_them(capsys, tmp_path):
    from hicache.core.config import HiCacheConfig
    from hicache.memory.pools import HostPool
    toml = tmp_path / "planes.toml"
    toml.write_text('[model]\nextra_planes = [["ix", 3]]\ndraft_layers = 1\n')  # odd-sized planes: gaps
    for layout in ("page_first", "layer_first"):
        got = _info(capsys, ["info", "--config", str(toml), "--set", f"model.host_layout={layout}"])
        cfg = HiCacheConfig.load(toml, {"model.host_layout": layout}, env={})
        assert got["pools"]["L2"]["bytes"] == HostPool.nbytes_for(cfg.layout(), cfg.pool.host_pages)
        assert got["pools"]["L2"]["bytes"] == HostPool(cfg.layout(), cfg.pool.host_pages).buffer.numel()


def test_info_redacts_secrets(capsys):
    got = _info(capsys, ["info", "--set", "storage.url=redis://u:hunter2@h:6379/0",
                         "--set", "service.admin_token=tok-secret"])
    text = json.dumps(got)
    assert "hunter2" not in text and "tok-secret" not in text
    assert got["pools"]["L3"] == "redis://u:***@h:6379/0" and got["config"]["service"]["admin_token"] == "***"


def test_info_describes_a_rows_layout(capsys, tmp_path):
    """The layout a vLLM tier logs (kind="rows") is one hicache serve can be configured with."""
    from hicache.core.layout import KVLayout
    lay = KVLayout.rows("vllm:m", 589824, {"engine": "vllm", "block": 16}, host_layout="page_first")
    toml = tmp_path / "rows.toml"
    toml.write_text("[model]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in lay.to_dict().items()))
    got = _info(capsys, ["info", "--config", str(toml), "--set", "pool.host_pages=3"])
    assert got["layout"] == {"fingerprint": lay.fingerprint(), "planes": 1, "page_bytes": 589824,
                             "token_bytes": 589824}
    assert got["pools"]["L2"]["bytes"] == 3 * 589824


def test_info_resolves_the_l3_cap(capsys, tmp_path):
    """``storage.max_bytes = "auto"`` shows as the cap it comes to on this machine."""
    from hicache.storage.capacity import default_cap
    url = f"file://{tmp_path}/l3"
    got = _info(capsys, ["info", "--set", f"storage.url={url}"])["pools"]
    assert got["L3_max_bytes"] == default_cap(url) > 0 and got["L3_cap"] == f"{default_cap(url) / 2**30:.1f} GiB (auto)"
    got = _info(capsys, ["info", "--set", "storage.url=memory://", "--set", "storage.max_bytes=3GiB"])["pools"]
    assert got["L3_max_bytes"] == 3 << 30 and got["L3_cap"] == "3.0 GiB (storage.max_bytes)"
    got = _info(capsys, ["info", "--set", "storage.url=memory://", "--set", "storage.max_bytes=0"])["pools"]
    assert got["L3_max_bytes"] == 0 and got["L3_cap"] == "unbounded (storage.max_bytes)"
    got = _info(capsys, ["info", "--set", "storage.url=redis://127.0.0.1:6379/0"])["pools"]
    assert got["L3_max_bytes"] is None and "maxmemory" in got["L3_cap"]


def test_info_warns_when_the_host_pools_exceed_ram(capsys, monkeypatch):
    import hicache.cli as cli
    monkeypatch.setattr(cli, "physical_memory", lambda: 1 << 30)  # a 1 GiB machine
    flags = ["--set", "pool.device=cpu", "--set", "pool.device_pages=128"]
    assert cli.main(["info", *flags, "--set", "pool.host_pages=2048"]) == 0  # 64 MiB + 4 MiB: fits
    out, err = capsys.readouterr()
    assert "warning" not in err and "warnings" not in json.loads(out)
    assert cli.main(["info", *flags, "--set", "pool.host_pages=40000"]) == 0  # 1.22 GiB of L2
    out, err = capsys.readouterr()
    want = ("hicache: warning: the pools in host memory need 1.2 GiB (L2 1.2 GiB, L1 (on the CPU) 0.0 GiB), "
            "more than this machine's 1.0 GiB of RAM; lower pool.host_pages")
    assert err.startswith(want), err
    assert json.loads(out)["warnings"] == [err.removeprefix("hicache: warning: ").strip()]

import pytest

from hicache.cli import main
from hicache.core.config import HiCacheConfig
from hicache.core.errors import ConfigError


def test_defaults_are_embedded():
    cfg = HiCacheConfig.load(env={})
    assert cfg.storage.url.startswith("file://")
    assert cfg.layout().page_size == 16


def test_precedence_file_env_override(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[pool]\nhost_pages = 10\ndevice_pages = 3\n[storage]\nurl = "memory://"\n')
    env = {"HICACHE_POOL__HOST_PAGES": "20"}
    cfg = HiCacheConfig.load(f, {"pool.device_pages": "7"}, env=env)
    assert (cfg.pool.host_pages, cfg.pool.device_pages, cfg.storage.url) == (20, 7, "memory://")


def test_bad_values_say_what_to_change(tmp_path):
    with pytest.raises(ConfigError) as e:
        HiCacheConfig.load(overrides={"pool.host_pages": "0"}, env={})
    assert "pool.host_pages='0'" in str(e.value) and "HICACHE_POOL__HOST_PAGES" in str(e.value)
    with pytest.raises(ConfigError, match="policy.write_policy"):
        HiCacheConfig.load(env={"HICACHE_POLICY__WRITE_POLICY": "sometimes"})
    with pytest.raises(ConfigError, match=r"policy.host_eviction.*must be one of .*slru"):
        HiCacheConfig.load(overrides={"policy.host_eviction": "lfru"}, env={})
    assert HiCacheConfig.load(overrides={"policy.device_eviction": "slru"}, env={}).policy.device_eviction == "slru"
    with pytest.raises(ConfigError, match=r"model.page_size=0: must be an integer in \[1, 4096\] \(set it in the config file"):
        HiCacheConfig.load(overrides={"model.page_size": 0}, env={})
    with pytest.raises(ConfigError, match="does not exist"):
        HiCacheConfig.load(tmp_path / "nope.toml", env={})
    with pytest.raises(ConfigError, match="nonsense"):
        HiCacheConfig.load(overrides={"pool.nonsense": 1}, env={})


def test_cli_info_prints_pools(capsys):
    assert main(["info", "--set", "pool.host_pages=8"]) == 0
    out = capsys.readouterr().out
    assert '"pages": 8' in out and "fingerprint" in out
    assert main(["info", "--set", "pool.host_pages=x"]) == 2
    assert "pool.host_pages='x'" in capsys.readouterr().err


def test_default_l3_is_per_user_whatever_the_current_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    urls = set()
    for d in (tmp_path / "a", tmp_path / "b"):
        d.mkdir()
        monkeypatch.chdir(d)
        urls.add(HiCacheConfig.load(env={}).storage.url)
    assert urls == {f"file://{tmp_path}/xdg/hicache/l3"}

"""A pool larger than this machine's memory is refused before anything is allocated, with
one sentence naming the setting, its value, the machine's memory and the fix, by every
entry point that sizes host memory: ``HiCache(...)``, ``hicache replay`` (and ``--simulate``),
``hicache serve``. (The vLLM connector's halves: tests/integrations/vllm_connector/
test_host_memory.py.) Before, a huge value was a bare ``MemoryError``, torch's allocator
error, or the kernel's OOM killer."""
from __future__ import annotations

import pytest

from hicache.cache.hicache import HiCache
from hicache.cli import main
from hicache.core import config as config_mod
from hicache.core.config import HiCacheConfig, HostNeed, check_host_memory, host_memory
from hicache.core.errors import ConfigError
from tests.hardening.conftest import config

HUGE = "1000000000000"  # pages: 10**12 pages of any layout is petabytes
RAM = host_memory()


def _err(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err  # --simulate says what it simulates first
    assert "Traceback" not in err and err.splitlines()[-1].startswith("hicache: error: "), err
    return err.splitlines()[-1]


@pytest.mark.parametrize("argv,named", [
    (["replay", "--set", f"pool.host_pages={HUGE}"], "pool.host_pages=1,000,000,000,000"),
    (["replay", "--set", "pool.device=cpu", "--set", f"pool.device_pages={HUGE}"],
     "pool.device_pages=1,000,000,000,000"),
    (["replay", "--simulate", "--set", "simulate.l2_bytes=10000000000000000"],
     "simulate.l2_bytes=10,000,000,000,000,000"),
    (["serve", "--set", f"pool.host_pages={HUGE}", "--set", "service.port=0"], "pool.host_pages=1,000,000,000,000"),
], ids=["replay_l2", "replay_l1_on_cpu", "simulate_l2", "serve"])
def test_the_cli_names_the_setting_and_the_memory(capsys, argv, named):
    cfg = config()  # a private socket path and segment name, for serve
    argv += ["--set", "storage.url=", "--set", f"service.socket_path={cfg.service.socket_path}",
             "--set", f"service.shm_name={cfg.service.shm_name}"]
    err = _err(capsys, argv)
    key = named.split("=")[0]
    assert f"{named} " in err and f"this machine's RAM of {RAM[0]:,} bytes" in err, err
    assert f"lower {key} well below " in err and f"--set {key}=" in err, err


def test_hicache_refuses_before_allocating():
    cfg = HiCacheConfig.load(overrides={"pool.host_pages": HUGE, "storage.url": ""}, env={})
    with pytest.raises(ConfigError, match=r"^pool\.host_pages=1,000,000,000,000 and pool\.device_pages=128 ask "
                                          r"for [\d,]+ bytes .* lower pool\.host_pages well below [\d,]+, "):
        HiCache(cfg)


def test_a_value_that_fits_is_built():
    hc = HiCache(HiCacheConfig.load(overrides={"pool.host_pages": 8, "pool.device_pages": 4, "storage.url": ""},
                                    env={}))
    assert hc.host_pool.num_pages == 8
    hc.check_integrity()
    hc.close()


def test_a_container_limit_below_the_ram_is_the_memory_named(tmp_path, monkeypatch):
    limit = tmp_path / "memory.max"
    limit.write_text(f"{1 << 30}\n")
    monkeypatch.setattr(config_mod, "_CGROUP_LIMITS", (str(tmp_path / "absent"), str(limit)))
    assert host_memory() == (1 << 30, f"container memory limit ({limit})")
    check_host_memory(HostNeed("host_bytes", 1 << 29, 1 << 29))  # fits: nothing raised
    with pytest.raises(ConfigError) as e:
        check_host_memory(HostNeed("host_bytes", 3 << 29, 3 << 29))
    assert str(e.value) == (f"host_bytes=1,610,612,736 asks for 1,610,612,736 bytes (1.5 GiB) of host memory, more "
                            f"than this machine's container memory limit ({limit}) of 1,073,741,824 bytes (1.0 GiB); "
                            "lower host_bytes well below 1,073,741,824, which would fill all of it")
    limit.write_text("max\n")  # cgroup v2's "no limit"
    assert host_memory() == RAM

"""A process that exits while the CPU transfer worker is inside a torch op
(an engine's exception skips ``close()``) must exit with its own status, not
abort: CPython ends a daemon thread that cannot retake the GIL at finalization
with ``pthread_exit``, whose unwind through torch's C++ frames calls
``std::terminate`` ("terminate called without an active exception", rc 134).
This is what aborted the README's service-mode example after a service restart."""
import subprocess
import sys
import textwrap

from hicache.core.layout import KVLayout
from hicache.memory.pools import DevicePool, HostPool
from hicache.transfer.engine import TransferController, _stop_at_exit

EXIT_WITH_LOADS_IN_FLIGHT = textwrap.dedent("""
    import torch
    from hicache.core.layout import KVLayout
    from hicache.memory.pools import DevicePool, HostPool
    from hicache.transfer.engine import TransferController

    lay = KVLayout(model_id="m", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
    dev, host = DevicePool(lay, 256, "cpu"), HostPool(lay, 256)
    tc = TransferController(dev, host)
    handles = [tc.load_back(list(range(256)), list(range(256))) for _ in range(40)]  # ~2 GiB of copies queued
    handles[0].wait_layer(0)           # the worker is copying
    raise SystemExit(3)                # leave without close(), as an example's exception does
""")


def test_exit_with_copies_in_flight_keeps_the_exit_status(tmp_path):
    out = subprocess.run([sys.executable, "-c", EXIT_WITH_LOADS_IN_FLIGHT], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert "terminate called" not in out.stderr, out.stderr
    assert out.returncode == 3, (out.returncode, out.stderr)


def _controller() -> TransferController:
    lay = KVLayout(model_id="m", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", page_size=4)
    return TransferController(DevicePool(lay, 4, "cpu"), HostPool(lay, 4, pin=False))


def test_exit_hook_stops_the_workers_and_close_unregisters_it():
    tc = _controller()
    tc.check_integrity()
    assert all(th.is_alive() for th in tc._threads) and len(tc._threads) == 2
    _stop_at_exit(lambda: tc)  # what atexit runs
    assert [th.is_alive() for th in tc._threads] == [False, False]
    try:
        tc.check_integrity()
    except AssertionError as e:
        assert "hicache-copy" in str(e) and "hicache-l3" in str(e), e
    else:
        raise AssertionError("check_integrity() accepted stopped workers on an open controller")
    tc.close()  # idempotent with respect to stopped workers; unregisters the hook
    tc.check_integrity()
    tc2 = _controller()
    tc2.close()
    assert [th.is_alive() for th in tc2._threads] == [False, False]
    tc2.check_integrity()

"""Where a HiCacheTier load's time goes, per chunk, against vLLM fs's read: a
readv straight into the row (what vLLM's fs tier does), hicache's file://
``get`` (open, read into a fresh buffer, verify: header compare + xxh3), the
copy into the row, xxh3 alone, raw redis-py MGET, hicache's redis:// ``get``.
Medians of 7; ~32 MiB per row size; tmpfs and a private redis-server.

    python bench/tier_load_parts.py      (any venv with hicache, numpy, redis)
"""
import os, time, statistics, tempfile, shutil, subprocess, socket, sys
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hicache.storage import open_storage
from hicache.core.layout import KVLayout
from hicache.storage import codec
def med(f, n=7):
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return statistics.median(ts)
d = tempfile.mkdtemp(dir="/dev/shm")
with socket.socket() as s:
    s.bind(("127.0.0.1",0)); port=s.getsockname()[1]
rp = subprocess.Popen(["redis-server","--port",str(port),"--save","","--appendonly","no","--dir",d], stdout=subprocess.DEVNULL)
time.sleep(0.5)
import redis
raw = redis.Redis(port=port)
print(f"{'row':>8} {'chunks':>6} | per chunk us: {'fs-style readv':>14} {'hc file get':>11} {'copy to row':>11} {'xxh3':>6} {'raw redis GET':>13} {'hc redis get':>12}")
for row in (16384, 65536, 2<<20, 8<<20):
    n = max(8, (32<<20)//row)
    lay = KVLayout.rows("m", row, {"e": 1})
    rows = np.random.default_rng(1).integers(0,256,(n,row),dtype=np.uint8)
    dst = np.zeros_like(rows)
    fsdir = f"{d}/fs{row}"; os.makedirs(fsdir)
    for i in range(n):
        with open(f"{fsdir}/{i}", "wb") as f: f.write(rows[i])
    def fs_read():
        for i in range(n):
            fd = os.open(f"{fsdir}/{i}", os.O_RDONLY); os.readv(fd, [memoryview(dst[i])]); os.close(fd)
    st = open_storage(f"file://{d}/hc{row}", fingerprint=lay.fingerprint(), timeout_ms=5000, layout=lay)
    keys = [i.to_bytes(16,"little") for i in range(n)]
    st.put([(k, memoryview(rows[i]), [row]) for i,k in enumerate(keys)])
    got = []
    def hc_get():
        got[:] = st.get(keys, [row])
    t_get = med(hc_get)
    def copy():
        for i,p in enumerate(got): memoryview(dst[i])[:] = p
    t_copy = med(copy)
    t_x = med(lambda: [codec.checksum(memoryview(rows[i])) for i in range(n)])
    rs = open_storage(f"redis://127.0.0.1:{port}/0", fingerprint=lay.fingerprint(), timeout_ms=5000, layout=lay, key_prefix=f"b{row}:")
    rs.put([(k, memoryview(rows[i]), [row]) for i,k in enumerate(keys)])
    for i,k in enumerate(keys): raw.set(b"raw%d" % i, rows[i].tobytes())
    t_raw = med(lambda: raw.mget([b"raw%d" % i for i in range(n)]))
    t_rget = med(lambda: rs.get(keys, [row]))
    t_fs = med(fs_read)
    print(f"{row//1024:>6} K {n:>6} | {t_fs/n*1e6:>28.1f} {t_get/n*1e6:>11.1f} {t_copy/n*1e6:>11.1f} {t_x/n*1e6:>6.1f} {t_raw/n*1e6:>13.1f} {t_rget/n*1e6:>12.1f}")
    st.close(); rs.close()
rp.terminate(); shutil.rmtree(d)

"""On a GPU, a load back's layer i is ready (and correct) before the last layer
has finished copying. Runs on the device machine (marker ``gpu``)."""
import pytest
import torch

from hicache.core.layout import KVLayout
from hicache.memory.pools import DevicePool, HostPool
from hicache.transfer.engine import TransferController

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_layer_ready_before_last_layer(host_layout):
    lay = KVLayout(model_id="m", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                   page_size=16, host_layout=host_layout)
    pages = 1024  # 2 GiB of KV: ~40 ms over PCIe, ~1.2 ms per layer
    dev = DevicePool(lay, pages, "cuda")
    host = HostPool(lay, pages)
    assert host.pinned
    g = torch.Generator().manual_seed(0)
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, generator=g, dtype=torch.uint8))
    tc = TransferController(dev, host)
    perm = torch.randperm(pages, generator=g).tolist()
    h = tc.load_back(perm, list(range(pages)))
    h.wait_layer(0)
    torch.cuda.current_stream().synchronize()
    assert h.layer_ready(0)
    assert not h.layer_ready(lay.num_layers - 1), "the last layer finished as early as the first"
    spec = lay.planes_of_layer(0)[0]
    got = dev.buffers[spec.index].view(pages, -1)[:8].cpu()
    want = torch.stack([host.plane_page(spec.index, p).reshape(-1) for p in perm[:8]]).cpu()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    h.wait()
    torch.cuda.synchronize()
    tc.wait_all()
    assert [r.job for r in tc.finished()] == [h.transfer.job]
    tc.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("uploads", ["one", "two"])
def test_graphed_load_back_equals_per_layer_launches(host_layout, uploads, monkeypatch):
    """The CUDA-graph load back (one replay, page count read on the device) moves exactly
    the pages the per-layer launches move, for any count, and nothing else; draft planes too.
    ``uploads``: the ids go up in one copy (small pools) or two (pools far larger than the load)."""
    import hicache.transfer.load_graph
    monkeypatch.setattr(hicache.transfer.load_graph, "_GAP_MAX", 32768 if uploads == "one" else 0)
    lay = KVLayout(model_id="m", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                   page_size=16, host_layout=host_layout, draft_layers=1)
    pages = 64
    host = HostPool(lay, pages)
    g = torch.Generator().manual_seed(1)
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, generator=g, dtype=torch.uint8))
    pools = {}
    for graphs in (True, False):
        dev = DevicePool(lay, pages, "cuda")
        for b in dev.buffers:
            b.view(torch.uint8).fill_(0xA5)  # untouched pages keep this
        tc = TransferController(dev, host, graphs=graphs)
        g = torch.Generator().manual_seed(2)
        for n in (1, 7, 33, pages, 5):  # several loads in a row, counts up and down
            src = torch.randperm(pages, generator=g)[:n].tolist()
            dst = torch.randperm(pages, generator=g)[:n].tolist()
            h = tc.load_back(src, dst)
            for i in range(lay.num_layers):
                h.wait_layer(i)
            h.wait()
        torch.cuda.synchronize()
        tc.wait_all()
        assert len(tc.finished()) == 5
        assert (tc._graph is not None) == graphs
        pools[graphs] = [b.clone() for b in dev.buffers]
        tc.close()
    for a, b in zip(pools[True], pools[False]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # ...and both are right: every destination page of the last load holds its source's bytes.
    dev_view = {spec.index: pools[True][spec.index].view(pages, -1) for spec in lay.planes}
    for spec in lay.planes:  # draft planes included
        for s_, d_ in zip(src, dst):
            assert torch.equal(dev_view[spec.index][d_].cpu().view(torch.uint8),
                               host.plane_page(spec.index, s_).reshape(-1).view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
def test_graphed_load_back_follows_a_new_host_pool():
    """Service mode maps a restarted service's segment as a new host pool: the next load
    back captures a new graph over it (never replays the old pool's addresses)."""
    lay = KVLayout(model_id="m", num_layers=2, num_kv_heads=1, head_dim=64, dtype="bfloat16",
                   page_size=16, host_layout="page_first")
    dev = DevicePool(lay, 8, "cuda")
    old, new = HostPool(lay, 8), HostPool(lay, 8)
    old.buffer.fill_(1)
    new.buffer.fill_(2)
    tc = TransferController(dev, old)
    tc.load_back([0], [0]).wait()
    first = tc._graph
    tc.host_pool = new
    tc.load_back([3], [1]).wait()
    torch.cuda.synchronize()
    assert tc._graph is not first and tc._graph.host is new
    assert all(bool((b.view(8, -1).view(torch.uint8)[0] == 1).all())
               and bool((b.view(8, -1).view(torch.uint8)[1] == 2).all()) for b in dev.buffers)
    tc.wait_all()
    tc.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
@pytest.mark.parametrize("completion", ["flags", "events"])
def test_a_stream_that_waits_for_layer_i_reads_it_loaded(completion, monkeypatch):
    """The forward's ordering, on the device: a consumer stream that waits for layer i
    (``wait_layer``) and then copies that layer's planes sees them loaded, for every layer,
    while later layers are still on the way (1024 pages: ~1.2 ms per layer). ``flags``: the
    kernels write per-layer epochs (stream memory operations); ``events``: event nodes.
    Two loads in a row, so the second waits on a later epoch of the same flags."""
    import hicache.transfer.load_graph
    if completion == "events":
        monkeypatch.setattr(hicache.transfer.load_graph, "_stream_wait_value_works", lambda dev: False)
    lay = KVLayout(model_id="m", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                   page_size=16, host_layout="page_first")
    pages = 1024
    dev = DevicePool(lay, pages, "cuda")
    host = HostPool(lay, pages)
    g = torch.Generator().manual_seed(5)
    tc = TransferController(dev, host)
    consumer = torch.cuda.Stream()
    for rep in range(2):
        host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, generator=g, dtype=torch.uint8))
        for b in dev.buffers:
            b.view(torch.uint8).fill_(0xA5)
        torch.cuda.synchronize()
        perm = torch.randperm(pages, generator=g).tolist()
        h = tc.load_back(perm, list(range(pages)))
        assert tc._graph.completion == completion
        snaps = []
        with torch.cuda.stream(consumer):
            for i in range(lay.num_layers):
                h.wait_layer(i)
                snaps.append([dev.buffers[s.index].clone() for s in lay.planes_of_layer(i)])
        consumer.synchronize()
        assert h.layer_ready(lay.num_layers - 1)
        for i in range(lay.num_layers):
            for spec, snap in zip(lay.planes_of_layer(i), snaps[i]):
                want = torch.stack([host.plane_page(spec.index, p).reshape(-1) for p in perm]).view(torch.uint8)
                assert torch.equal(snap.view(pages, -1).view(torch.uint8).cpu(), want.cpu()), (rep, i, spec.name)
        tc.wait_all()
        tc.finished()
    tc.check_integrity()
    tc.close()

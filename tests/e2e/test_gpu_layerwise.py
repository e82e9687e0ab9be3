"""On a GPU, a load back's layer i is ready (and correct) before the last layer
has finished copying. Runs on the device machine (marker ``gpu``)."""
import pytest
import torch

from hicache.layout import KVLayout
from hicache.pools import DevicePool, HostPool
from hicache.transfer import TransferController

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
    assert [r.job for r in tc.finished()] == [h.transfer.job] and h.transfer.done
    tc.close()

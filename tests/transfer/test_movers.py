"""The transfer engine picks a plan's mover by its (source, destination) medium: every
plan kind has one, a route without one is refused by name, and a new route is one more
entry in ``MOVERS`` (tiny CPU pools, exact bytes)."""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from hicache.core.layout import KVLayout
from hicache.core.types import HostPageId
from hicache.memory.pools import DevicePool, HostPool
from hicache.tiers.plans import BackupPlan, LoadPlan, PrefetchPlan, StorePlan
from hicache.transfer import engine
from hicache.transfer.engine import MOVERS, TransferController
from hicache.transfer.media import FULL, L1_TO_L2, L2_TO_L1, L2_TO_L3, L3_TO_L2, Medium, Route

LAY = KVLayout("tiny", 1, num_kv_heads=1, head_dim=2, page_size=2, dtype="float32")


class L2ToL2(NamedTuple):
    """A plan of a route no tier has: L2 pages ``host`` onto L2 pages ``dst``."""

    host: list[HostPageId]
    dst: list[HostPageId]
    group: int = FULL
    route: Route = (Medium.L2, Medium.L2)


@pytest.fixture
def tc():
    t = TransferController(DevicePool(LAY, 4, "cpu"), HostPool(LAY, 4), inline=True)
    yield t
    t.close()


def test_every_plan_kind_has_the_mover_of_its_route():
    routes = {p._field_defaults["route"] for p in (BackupPlan, LoadPlan, StorePlan, PrefetchPlan)}
    assert routes == {L1_TO_L2, L2_TO_L1, L2_TO_L3, L3_TO_L2} == set(MOVERS)


def test_a_route_without_a_mover_is_refused_by_name(tc):
    with pytest.raises(TypeError, match="no mover from L2 to L2; registered: L1->L2, L2->L1, L2->L3, L3->L2"):
        tc.submit(L2ToL2([HostPageId(0)], [HostPageId(1)]))


def test_a_new_route_is_one_more_mover(tc, monkeypatch):
    def l2_to_l2(t: TransferController, plan: L2ToL2) -> engine.Transfer:
        t.host_pool.write_page(plan.dst[0], t.host_pool.read_page(plan.host[0]))
        return engine.Transfer(engine.TransferKind.D2H, engine.JobId(99))
    monkeypatch.setitem(MOVERS, (Medium.L2, Medium.L2), l2_to_l2)
    page = torch.arange(tc.host_pool.layout.page_bytes, dtype=torch.uint8) % 251
    tc.host_pool.write_page(0, page.numpy().tobytes())
    assert tc.submit(L2ToL2([HostPageId(0)], [HostPageId(3)])) == 99
    assert bytes(tc.host_pool.read_page(3)) == page.numpy().tobytes()

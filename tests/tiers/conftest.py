"""The whole tiers suite runs with the L2 page state machine on (``hicache.tiers.host_states``):
every tier manager built here checks each L2 page transition, and every
``check_integrity`` cross-checks the states with the allocator and the index."""
import pytest

from hicache.tiers.host_states import ENV


@pytest.fixture(autouse=True)
def debug_states(monkeypatch):
    monkeypatch.setenv(ENV, "1")

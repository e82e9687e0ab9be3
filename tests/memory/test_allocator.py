import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.memory.allocator import PageAllocator
from hicache.core.errors import DoubleFree, ForeignPage, OutOfPages


def test_alloc_order_and_free():
    a = PageAllocator(4, "t")
    assert a.alloc(3) == [0, 1, 2]
    a.free([1])
    assert a.alloc(1) == [1]
    assert a.num_free == 1
    a.check_integrity()


def test_errors_name_values():
    a = PageAllocator(2, "L1")
    with pytest.raises(OutOfPages, match="asked for 3 pages, 2 free"):
        a.alloc(3)
    assert a.num_free == 2  # nothing allocated on failure
    p = a.alloc(1)
    a.free(p)
    with pytest.raises(DoubleFree, match="page 0"):
        a.free(p)
    with pytest.raises(ForeignPage, match="page id 7"):
        a.free([7])
    with pytest.raises(ForeignPage):
        a.free([-1])
    q = a.alloc(2)
    with pytest.raises(DoubleFree):
        a.free([q[0], q[0]])  # the same page twice in one call
    # all-or-nothing: the failed call freed nothing
    assert a.num_free == 0
    a.check_integrity()


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.a = PageAllocator(16, "h")
        self.held: list[int] = []

    @rule(n=st.integers(0, 6))
    def alloc(self, n):
        if n > self.a.num_free:
            with pytest.raises(OutOfPages):
                self.a.alloc(n)
            return
        got = self.a.alloc(n)
        assert len(got) == n and not set(got) & set(self.held)
        self.held += got

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        k = data.draw(st.integers(1, len(self.held)))
        idx = data.draw(st.permutations(range(len(self.held))))[:k]
        pages = [self.held[i] for i in idx]
        self.a.free(pages)
        self.held = [p for p in self.held if p not in pages]

    @precondition(lambda self: self.a.num_free)
    @rule()
    def double_free_detected(self):
        free_page = next(p for p in range(16) if p not in self.held)
        with pytest.raises(DoubleFree):
            self.a.free([free_page])

    @invariant()
    def balanced(self):
        self.a.check_integrity()
        assert self.a.num_used == len(self.held)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)

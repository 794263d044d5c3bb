"""Note [Shared limit] (mempool/_csrc/core/mp_release.c): a pool that shares another's limit
counts its reserved bytes against it, as PyTorch's memory fraction caps a device's CUDA
graphs and MemPools with the rest (the torch glue makes each private pool share its device
pool's limit). On sim, through the core's test hook."""
import gc
import threading

import pytest

import mempool
from mempool import _core

MiB = 1 << 20


def sim(**options):
    return mempool.Pool(backend="sim", capacity="4GiB", **options)


def private(**options):
    """A pool as the torch glue makes a graph's: it keeps its idle memory (keep_idle is not
    reachable from Python; a release threshold of None is the nearest)."""
    return sim(**options)


def test_a_member_counts_against_the_owners_limit_and_the_owner_against_the_members():
    owner, member = sim(limit="256MiB"), private()
    _core._share_limit(member, owner)
    a = member.alloc(100 * MiB)
    b = owner.alloc(100 * MiB)
    with pytest.raises(mempool.OutOfMemoryError):
        owner.alloc(100 * MiB)                  # 300 MiB in all: past the owner's limit
    with pytest.raises(mempool.OutOfMemoryError):
        member.alloc(100 * MiB)                 # and the member's request too
    c = member.alloc(40 * MiB)                  # 240 MiB in all: fits
    for pool, ptr in ((member, a), (owner, b), (member, c)):
        pool.free(ptr)
    member.empty_cache()
    b = owner.alloc(250 * MiB)                  # the member gave its memory back: room
    owner.free(b)
    for pool in (owner, member):
        pool.check_invariants()


def test_the_owner_releases_its_own_idle_memory_to_make_room_for_its_request():
    owner, member = sim(limit="256MiB"), private()
    _core._share_limit(member, owner)
    owner.free(owner.alloc(120 * MiB))          # idle in the owner
    held = member.alloc(100 * MiB)
    ptr = owner.alloc(150 * MiB)                # 370 without the idle 120: it goes first
    assert owner.reserved_bytes() == 150 * MiB
    owner.free(ptr)
    member.free(held)


def test_set_limit_on_the_owner_applies_to_the_members_at_once():
    owner, member = sim(), private()
    _core._share_limit(member, owner)
    a = member.alloc(100 * MiB)
    owner.set_limit("128MiB")
    with pytest.raises(mempool.OutOfMemoryError):
        member.alloc(64 * MiB)
    owner.set_limit(None)
    b = member.alloc(64 * MiB)
    member.free(a)
    member.free(b)


def test_a_member_keeps_its_own_limit_too():
    owner, member = sim(limit="1GiB"), private(limit="64MiB")
    _core._share_limit(member, owner)
    with pytest.raises(mempool.OutOfMemoryError):
        member.alloc(100 * MiB)
    member.free(member.alloc(60 * MiB))


def test_a_destroyed_member_gives_its_share_back_and_keeps_its_owner_alive_until_then():
    owner, member = sim(limit="256MiB"), private()
    _core._share_limit(member, owner)
    member.alloc(200 * MiB)                     # never freed: goes with the pool
    with pytest.raises(mempool.OutOfMemoryError):
        owner.alloc(100 * MiB)
    del member
    gc.collect()
    owner.free(owner.alloc(250 * MiB))
    owner.check_invariants()
    # The owner's Python object may go first: the member's reference keeps its struct.
    owner2, member2 = sim(limit="256MiB"), private()
    _core._share_limit(member2, owner2)
    del owner2
    gc.collect()
    member2.free(member2.alloc(200 * MiB))
    with pytest.raises(mempool.OutOfMemoryError):
        member2.alloc(300 * MiB)                # the owner's limit still holds
    member2.check_invariants()


def test_pools_that_share_nothing_are_as_before():
    pool = sim(limit="256MiB")
    a = pool.alloc(200 * MiB)
    with pytest.raises(mempool.OutOfMemoryError):
        pool.alloc(100 * MiB)
    pool.free(a)
    b = pool.alloc(250 * MiB)
    pool.free(b)
    pool.check_invariants()


def test_expandable_members_and_owners_count_their_pages():
    owner, member = sim(limit="256MiB", expandable_segments=True), private()
    _core._share_limit(member, owner)
    a = member.alloc(100 * MiB)
    with pytest.raises(mempool.OutOfMemoryError):
        owner.alloc(200 * MiB)
    b = owner.alloc(150 * MiB)
    owner.free(b)
    member.free(a)
    owner.check_invariants()


@pytest.mark.parametrize("how", ["itself", "twice", "owner is a member", "member is an owner",
                                 "holds memory"])
def test_refusals_change_nothing(how):
    owner, member, other = sim(limit="256MiB"), private(), private()
    if how == "itself":
        args = (owner, owner)
    elif how == "twice":
        _core._share_limit(member, owner)
        args = (member, other)
    elif how == "owner is a member":
        _core._share_limit(member, owner)
        args = (other, member)
    elif how == "member is an owner":
        _core._share_limit(member, owner)
        args = (owner, other)
    else:
        ptr = member.alloc(MiB)
        args = (member, owner)
    with pytest.raises(ValueError, match="member"):
        _core._share_limit(*args)
    big = owner.alloc(250 * MiB)                # the owner's limit counts what it did before
    owner.free(big)
    if how == "holds memory":
        member.free(ptr)
        member.free(member.alloc(300 * MiB))    # not a member: no limit
    with pytest.raises(TypeError):
        _core._share_limit(member, "owner")


def test_threads_growing_two_pools_at_once_stay_within_a_segment_of_the_limit():
    owner, member = sim(limit="512MiB"), private()
    _core._share_limit(member, owner)
    held = {owner: [], member: []}

    def grow(pool):
        for _ in range(200):
            try:
                held[pool].append(pool.alloc(8 * MiB))
            except mempool.OutOfMemoryError:
                pass
    threads = [threading.Thread(target=grow, args=(p,)) for p in (owner, member)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = owner.reserved_bytes() + member.reserved_bytes()
    assert total <= 512 * MiB + 64 * MiB, total     # Note [Shared limit]: one segment each
    for pool, ptrs in held.items():
        for ptr in ptrs:
            pool.free(ptr)
        pool.check_invariants()


# ---- random programs over an owner and a member ----------------------------------------------

import hypothesis.strategies as st  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant,  # noqa: E402
                                 precondition, rule)

SIZES = st.sampled_from([512, 600 << 10, 3 << 20, 24 << 20, 70 << 20, 130 << 20])
LIMITS = st.sampled_from([None, 64 << 20, 160 << 20, 300 << 20])


class SharedLimitMachine(RuleBasedStateMachine):
    """Whatever the owner and its member do, a growth of either never takes the two past the
    owner's limit (on one thread the check is exact), and both pools' books hold."""
    owner_options = {}

    @initialize(limit=LIMITS)
    def make_pools(self, limit):
        # 16 GiB: 40 steps of at most 130 MiB never fill the device without a limit.
        self.owner = mempool.Pool(backend="sim", capacity="16GiB", limit=limit,
                                  **self.owner_options)
        self.member = mempool.Pool(backend="sim", capacity="16GiB")
        _core._share_limit(self.member, self.owner)
        self.limit = limit
        self.live = []        # (pool, ptr)

    def total(self):
        return self.owner.reserved_bytes() + self.member.reserved_bytes()

    @rule(member=st.booleans(), nbytes=SIZES)
    def alloc(self, member, nbytes):
        pool = self.member if member else self.owner
        before = self.total()
        try:
            ptr = pool.alloc(nbytes)
        except mempool.OutOfMemoryError:
            assert self.limit is not None, "refused with no limit on a 4 GiB device"
            return
        self.live.append((pool, ptr))
        if self.limit is not None and self.total() > before:
            assert self.total() <= self.limit, (self.total(), self.limit)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        pool, ptr = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        pool.free(ptr)

    @rule(member=st.booleans())
    def empty_cache(self, member):
        (self.member if member else self.owner).empty_cache()

    @rule(limit=LIMITS)
    def set_limit(self, limit):
        self.owner.set_limit(limit)
        self.limit = limit

    @invariant()
    def books_hold(self):
        if hasattr(self, "owner"):
            self.owner.check_invariants()
            self.member.check_invariants()


class ExpandableOwnerMachine(SharedLimitMachine):
    owner_options = {"expandable_segments": True}


MACHINE_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])
TestSharedLimitMachine = SharedLimitMachine.TestCase
TestSharedLimitMachine.settings = MACHINE_SETTINGS
TestExpandableOwnerMachine = ExpandableOwnerMachine.TestCase
TestExpandableOwnerMachine.settings = MACHINE_SETTINGS


def test_what_a_limit_turns_off_it_turns_off_under_the_owners_limit_too():
    # min_map_size rounds a growth at a range's edge up, but not under a limit, where the
    # rounding could refuse what fits (Note [Edge growth]); under only an owner's limit the
    # member rounded 8 MiB up to 64 MiB, past the owner's 32, and was refused.
    owner = sim(limit="32MiB")
    member = sim(expandable_segments=True, min_map_size="64MiB")
    _core._share_limit(member, owner)
    ptr = member.alloc(8 * MiB)
    assert member.reserved_bytes() <= 32 * MiB
    member.free(ptr)
    # The out-of-memory report names the limit that refused.
    with pytest.raises(mempool.OutOfMemoryError, match="32.00 MiB"):
        member.alloc(40 * MiB)
    member.check_invariants()

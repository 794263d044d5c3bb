"""The cudaMemPool release threshold a Pool on backend="cuda" sets for its own
``release_threshold`` (Note [The driver keeps nothing given back], mempool/_cuda.py); the
GPU test that the device then holds nothing the Pool gave back is in
tests/gpu/test_gpu_cudapool.py."""
import pytest

from mempool import _cuda


def test_a_created_cudamempool_keeps_nothing_freed_when_the_pool_caches():
    assert _cuda.driver_release_threshold("create", None) == 0


@pytest.mark.parametrize("handle", ["default", "current", 0x7f00_1234_0000])
def test_a_shared_cudamempool_keeps_its_owners_threshold(handle):
    assert _cuda.driver_release_threshold(handle, None) is None


@pytest.mark.parametrize("handle", ["create", "default", 0x7f00_1234_0000])
@pytest.mark.parametrize("given", [0, 2 << 30, _cuda.KEEP_ALL])
def test_a_threshold_given_is_set_on_any_cudamempool(handle, given):
    assert _cuda.driver_release_threshold(handle, given) == given


class _Runtime:
    """CuPy's runtime bindings as configure() uses them, recording each attribute set."""
    cudaMemPoolAttrReleaseThreshold = 4
    cudaMemPoolReuseFollowEventDependencies = 1
    cudaMemPoolReuseAllowOpportunistic = 2
    cudaMemPoolReuseAllowInternalDependencies = 3

    def __init__(self):
        self.set = []

    def memPoolSetAttribute(self, handle, attr, value):
        self.set.append((handle, attr, value))


def test_leaving_the_threshold_as_it_is_sets_nothing(monkeypatch):
    rt = _Runtime()
    monkeypatch.setattr(_cuda, "_runtime", lambda: rt)
    _cuda.configure(0x1000, release_threshold=_cuda.driver_release_threshold("default", None))
    assert rt.set == []
    _cuda.configure(0x1000, release_threshold=_cuda.driver_release_threshold("create", None))
    assert rt.set == [(0x1000, rt.cudaMemPoolAttrReleaseThreshold, 0)]

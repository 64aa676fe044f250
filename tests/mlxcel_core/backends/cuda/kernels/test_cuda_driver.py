"""kernels/cuda_driver.py without a GPU: the launch-config structs as cuda.h lays them out, which recorded
launches `issue_launches` chains programmatically (cubin_cache.pdl_enabled), and how `addresses` batches its reads
(one kernel variant a dtype); on CUDA, the addresses themselves."""

from __future__ import annotations

import ctypes

import mlx.core as mx
import pytest

from mlxcel_core.backends.cuda.kernels.cubin_cache import Launch
from mlxcel_core.backends.cuda.kernels.cuda_driver import (
    PROGRAMMATIC_STREAM_SERIALIZATION,
    LaunchAttribute,
    LaunchConfig,
    issue_launches,
    programmatic_config,
)


def test_the_launch_structs_have_cuda_hs_layout():
    # sizeof / offsetof from a C program built against CUDA 13.0's cuda.h: 72 8 56 32 40 48
    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(LaunchConfig) == 56
    assert (LaunchConfig.stream.offset, LaunchConfig.attrs.offset, LaunchConfig.num_attrs.offset) == (32, 40, 48)


def test_a_programmatic_config_carries_the_serialization_attribute():
    config, attribute = programmatic_config([3, 2, 1], [128, 1, 1], ctypes.c_void_p(1234))
    assert list(config.grid) == [3, 2, 1] and list(config.block) == [128, 1, 1] and config.stream == 1234
    assert config.num_attrs == 1 and config.attrs.contents.id == PROGRAMMATIC_STREAM_SERIALIZATION == 6
    assert bytes(attribute)[8:12] == (1).to_bytes(4, "little")  # programmaticStreamSerializationAllowed


class RecordingDriver:
    def __init__(self):
        self.launched = []

    def function(self, name, cubin):
        return name

    def launch(self, fn, blocks, threads, args, programmatic=False):
        self.launched.append((fn, blocks, [a.value for a in args], programmatic))


def test_only_later_launches_of_kernels_that_wait_themselves_are_chained():
    a, b = mx.zeros((4,)), mx.zeros((4,))
    where = {id(a): 100, id(b): 200}
    launches = [
        Launch("k0", b"", [a], [b], [7], (256, 1, 1), (128, 1, 1), pdl=True),
        Launch("k1", b"", [b], [a], [], (64, 2, 1), (32, 1, 1), pdl=True),
        Launch("k2", b"", [a], [b], [], (1, 1, 1), (1, 1, 1), pdl=False),
    ]
    driver = RecordingDriver()
    issue_launches(driver, launches, where, programmatic=True)
    assert driver.launched == [
        ("k0", [2, 1, 1], [100, 200, 7], False),
        ("k1", [2, 2, 1], [200, 100], True),
        ("k2", [1, 1, 1], [100, 200], False),
    ]
    driver = RecordingDriver()
    issue_launches(driver, launches, where)
    assert [p for *_, p in driver.launched] == [False, False, False]


class RecordingLib:
    """Stands in for libcuda: every call is recorded and succeeds."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, *[getattr(a, "value", a) for a in args]))
            return 0

        return call


def test_close_frees_what_the_driver_made_once_its_stream_is_idle():
    from mlxcel_core.backends.cuda.kernels.cuda_driver import Driver

    driver = Driver.__new__(Driver)  # no libcuda here: its bookkeeping only
    driver.lib, driver.stream, driver.functions, driver.modules = RecordingLib(), ctypes.c_void_p(7), {}, []
    driver.context = ctypes.c_void_p(5)
    driver._owned = [
        ("cuModuleUnload", ctypes.c_void_p(1)),
        ("cuMemFreeHost", ctypes.c_void_p(2)),
        ("cuEventDestroy_v2", ctypes.c_void_p(3)),
    ]
    driver.functions["k"] = ctypes.c_void_p(9)
    driver.close()
    calls = driver.lib.calls
    assert calls[:-1] == [
        ("cuCtxPushCurrent_v2", 5),
        ("cuStreamSynchronize", 7),
        ("cuEventDestroy_v2", 3),
        ("cuMemFreeHost", 2),
        ("cuModuleUnload", 1),
        ("cuStreamDestroy_v2", 7),
    ]
    assert calls[-1][0] == "cuCtxPopCurrent_v2"  # the thread's own context back
    assert driver.stream is None and not driver.functions and not driver._owned
    driver.close()  # a second close does nothing
    assert len(driver.lib.calls) == 7


# -- addresses: one kernel variant per dtype ----------------------------------------------------------------------
class FakeAddressKernel:
    """Stands in for the address kernel: each input's 'address' is a number given to the array object."""

    def __init__(self):
        self.launches, self.numbers = [], {}

    def __call__(self, *, inputs, grid, threadgroup, output_shapes, output_dtypes):
        self.launches.append([x.dtype for x in inputs])
        found = [self.numbers.setdefault(id(x), 1000 + len(self.numbers)) for x in inputs]
        return [mx.array(found, dtype=output_dtypes[0])]


def test_addresses_come_back_in_order_from_full_launches_of_one_dtype(monkeypatch):
    """Every launch reads exactly ADDRESS_BATCH arrays of one dtype (so its kernel variant is one per dtype, compiled
    once, whatever the count and mix asked for), and each array's address comes back at its own position."""
    from mlxcel_core.backends.cuda.kernels import cuda_driver

    fake = FakeAddressKernel()
    monkeypatch.setattr(cuda_driver, "_address_kernel", lambda ensure_row_contiguous: fake)
    kinds = [mx.bfloat16, mx.uint32, mx.float32]
    arrays = [mx.zeros((2,), kinds[i % 3]) for i in range(150)]  # 50 of each, interleaved
    found = cuda_driver.addresses(arrays)
    assert found == [fake.numbers[id(a)] for a in arrays] and len(set(found)) == 150
    assert all(len(dtypes) == cuda_driver.ADDRESS_BATCH and len(set(dtypes)) == 1 for dtypes in fake.launches)
    assert sorted(str(dtypes[0]) for dtypes in fake.launches) == sorted(map(str, kinds))  # 50 each: one launch a dtype
    fake.launches.clear()
    (token,) = arrays[1:2]
    assert cuda_driver.addresses([token]) == [found[1]]  # one array: the same variant as its dtype's full launches
    assert fake.launches == [[mx.uint32] * cuda_driver.ADDRESS_BATCH]
    assert cuda_driver.addresses([]) == []


@pytest.mark.skipif(not (getattr(mx, "cuda", None) and mx.cuda.is_available()), reason="needs CUDA")
def test_addresses_on_the_gpu_are_where_mlx_passes_each_array():
    from mlxcel_core.backends.cuda.kernels.cuda_driver import addresses

    base = mx.arange(100, dtype=mx.float32)
    views = [base[10:], base[20:]]  # slices share the buffer, at their offsets
    square = mx.arange(16, dtype=mx.float32).reshape(4, 4)
    transposed = square.T  # not row contiguous: ensure_row_contiguous reads a copy's address instead
    mx.eval(base, *views, square, transposed)
    at_base, at_10, at_20, at_square, at_t = addresses([base, *views, square, transposed])
    assert (at_10 - at_base, at_20 - at_base) == (40, 80) and at_t == at_square
    assert addresses([transposed], ensure_row_contiguous=True)[0] != at_square
    assert addresses([base[20:]]) == [at_20]  # one array alone: the same answer

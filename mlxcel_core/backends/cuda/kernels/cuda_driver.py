"""The few CUDA driver calls that replay our kernels outside MLX (backends/cuda/graph_decode.py,
benchmarks/graph_replay.py): load a cubin, launch a function, capture launches into a CUDA graph and launch it, copy
a few bytes.

Through ctypes on libcuda, on the context MLX made current (the device's primary context), with a stream of our own.
CUDA only; nothing here runs on import.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

import mlx.core as mx

from . import cubin_cache

c_void_p, c_uint, c_size_t, c_uint64 = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t, ctypes.c_uint64
byref = ctypes.byref
CAPTURE_RELAXED = 2  # cudaStreamCaptureModeRelaxed: MLX's own calls on its threads are not part of a capture
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union (72 bytes, as cuda.h 13.0 lays it out)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (56 bytes: the stream at offset 32, the attributes at 40, their count at 48)."""

    _fields_ = [
        ("grid", c_uint * 3),
        ("block", c_uint * 3),
        ("shared_bytes", c_uint),
        ("stream", c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)),
        ("num_attrs", c_uint),
    ]


def programmatic_config(blocks, threads, stream) -> tuple[LaunchConfig, LaunchAttribute]:
    """A launch's config that lets it start before the stream's previous kernel ends (the kernel waits itself:
    cubin_cache.PDL_PROLOGUE). The attribute is returned too: the config points at it."""
    attribute = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    attribute.value = (1).to_bytes(4, "little")  # programmaticStreamSerializationAllowed
    config = LaunchConfig((c_uint * 3)(*blocks), (c_uint * 3)(*threads), 0, stream, ctypes.pointer(attribute), 1)
    return config, attribute


class Driver:
    def __init__(self):
        self.lib = lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernel.argtypes = [c_void_p] + [c_uint] * 7 + [c_void_p, c_void_p, c_void_p]
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), c_void_p, c_void_p, c_void_p]
        lib.cuMemsetD8Async.argtypes = [c_uint64, ctypes.c_ubyte, c_size_t, c_void_p]
        lib.cuMemcpyDtoDAsync_v2.argtypes = [c_uint64, c_uint64, c_size_t, c_void_p]
        lib.cuMemcpyHtoDAsync_v2.argtypes = [c_uint64, c_void_p, c_size_t, c_void_p]
        lib.cuMemcpyDtoHAsync_v2.argtypes = [c_void_p, c_uint64, c_size_t, c_void_p]
        lib.cuMemcpyDtoH_v2.argtypes = [c_void_p, c_uint64, c_size_t]
        lib.cuGraphInstantiateWithFlags.argtypes = [c_void_p, c_void_p, ctypes.c_ulonglong]
        lib.cuGraphLaunch.argtypes = [c_void_p, c_void_p]
        lib.cuEventRecord.argtypes = [c_void_p, c_void_p]
        for name in (
            "cuStreamSynchronize",
            "cuEventSynchronize",
            "cuGraphExecDestroy",
            "cuGraphDestroy",
            "cuMemFreeHost",
            "cuEventDestroy_v2",
            "cuModuleUnload",
            "cuStreamDestroy_v2",
            "cuCtxPushCurrent_v2",
        ):
            getattr(lib, name).argtypes = [c_void_p]
        self.check(lib.cuInit(0), "cuInit")
        ctx = c_void_p()
        self.check(lib.cuCtxGetCurrent(byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:  # this thread has not used CUDA through the runtime yet: the device's primary context
            dev = ctypes.c_int()
            self.check(lib.cuDeviceGet(byref(dev), 0), "cuDeviceGet")
            self.check(lib.cuDevicePrimaryCtxRetain(byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self.check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self.context = ctx
        self.stream = c_void_p()
        self.check(lib.cuStreamCreate(byref(self.stream), 1), "cuStreamCreate")  # 1: non-blocking
        self.functions: dict[str, c_void_p] = {}
        self.modules: list[bytes] = []  # the loaded cubins' bytes
        self._owned: list[tuple[str, c_void_p]] = []  # (how to free it, handle): what `close` gives back

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, byref(text))
            raise RuntimeError(f"{what}: CUDA error {rc} ({(text.value or b'?').decode()})")

    def function(self, name: str, cubin: bytes) -> c_void_p:
        """`name` of a cubin (loaded once per name)."""
        if name not in self.functions:
            module, fn = c_void_p(), c_void_p()
            self.modules.append(cubin)
            self.check(self.lib.cuModuleLoadData(byref(module), cubin), f"cuModuleLoadData {name}")
            self._owned.append(("cuModuleUnload", module))
            self.check(self.lib.cuModuleGetFunction(byref(fn), module, name.encode()), f"cuModuleGetFunction {name}")
            self.functions[name] = fn
        return self.functions[name]

    def launch(self, fn, blocks, threads, args: list, programmatic: bool = False) -> None:
        """`args`: ctypes values in the kernel's parameter order (c_uint64 addresses, c_int / c_float scalars);
        `programmatic`: the launch may start before the stream's previous kernel ends (`programmatic_config`)."""
        params = (c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        if programmatic:
            config, _attribute = programmatic_config(blocks, threads, self.stream)
            rc = self.lib.cuLaunchKernelEx(byref(config), fn, ctypes.cast(params, c_void_p), None)
            self.check(rc, "cuLaunchKernelEx")
            return
        rc = self.lib.cuLaunchKernel(fn, *blocks, *threads, 0, self.stream, ctypes.cast(params, c_void_p), None)
        self.check(rc, "cuLaunchKernel")

    def copy_on_device(self, dst: int, src: int, nbytes: int) -> None:
        self.check(self.lib.cuMemcpyDtoDAsync_v2(dst, src, nbytes, self.stream), "cuMemcpyDtoDAsync")

    def upload(self, dst: int, host: c_void_p, nbytes: int) -> None:
        """From pinned memory (`pinned`), queued: `host` must hold its bytes until the copy has run."""
        self.check(self.lib.cuMemcpyHtoDAsync_v2(dst, host, nbytes, self.stream), "cuMemcpyHtoDAsync")

    def download(self, host: c_void_p, src: int, nbytes: int) -> None:
        self.check(self.lib.cuMemcpyDtoHAsync_v2(host, src, nbytes, self.stream), "cuMemcpyDtoHAsync")

    def fill_zero(self, dst: int, nbytes: int) -> None:
        self.check(self.lib.cuMemsetD8Async(dst, 0, nbytes, self.stream), "cuMemsetD8Async")

    def capture(self, body) -> c_void_p:
        """What `body()` issues on the stream, as an instantiated CUDA graph (its template destroyed)."""
        graph, exe = c_void_p(), c_void_p()
        self.check(self.lib.cuStreamBeginCapture_v2(self.stream, CAPTURE_RELAXED), "cuStreamBeginCapture")
        try:
            body()
        finally:
            rc = self.lib.cuStreamEndCapture(self.stream, byref(graph))
        self.check(rc, "cuStreamEndCapture")
        self.check(self.lib.cuGraphInstantiateWithFlags(byref(exe), graph, 0), "cuGraphInstantiate")
        self.lib.cuGraphDestroy(graph)
        return exe

    def launch_graph(self, exe) -> None:
        self.check(self.lib.cuGraphLaunch(exe, self.stream), "cuGraphLaunch")

    def destroy_graph(self, exe) -> None:
        self.lib.cuGraphExecDestroy(exe)

    def pinned(self, nbytes: int) -> c_void_p:
        ptr = c_void_p()
        self.check(self.lib.cuMemAllocHost_v2(byref(ptr), nbytes), "cuMemAllocHost")
        self._owned.append(("cuMemFreeHost", ptr))
        return ptr

    def event(self) -> c_void_p:
        ev = c_void_p()
        self.check(self.lib.cuEventCreate(byref(ev), 2), "cuEventCreate")  # 2: CU_EVENT_DISABLE_TIMING
        self._owned.append(("cuEventDestroy_v2", ev))
        return ev

    def record(self, event) -> None:
        self.check(self.lib.cuEventRecord(event, self.stream), "cuEventRecord")

    def wait(self, event) -> None:
        self.check(self.lib.cuEventSynchronize(event), "cuEventSynchronize")

    def synchronize(self) -> None:
        self.check(self.lib.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def close(self) -> None:
        """Wait for the stream, then free what this driver made: pinned buffers, events, loaded cubins, its stream
        (the caller destroys its graphs first). Nothing of it may be used afterwards."""
        if self.stream is None:
            return
        with self.current():
            self.synchronize()
            for free, handle in reversed(self._owned):
                getattr(self.lib, free)(handle)
            self._owned.clear()
            self.functions.clear()
            self.lib.cuStreamDestroy_v2(self.stream)
            self.stream = None

    @contextlib.contextmanager
    def current(self):
        """This driver's context current on the calling thread, the thread's own restored after (a finalizer may run
        on any thread)."""
        self.check(self.lib.cuCtxPushCurrent_v2(self.context), "cuCtxPushCurrent")
        try:
            yield
        finally:
            self.lib.cuCtxPopCurrent_v2(byref(c_void_p()))

    def read(self, address: int, nbytes: int) -> bytes:
        """`nbytes` at `address`, after the stream's queued work."""
        buf = ctypes.create_string_buffer(nbytes)
        self.synchronize()
        self.check(self.lib.cuMemcpyDtoH_v2(buf, address, nbytes), "cuMemcpyDtoH")
        return buf.raw


def issue_launches(driver: Driver, launches: list, where: dict[int, int], programmatic: bool = False) -> None:
    """Issue recorded launches (cubin_cache.Launch) on the driver's stream, as MLX would make them: the inputs' and
    outputs' addresses (`where`: array id -> address), then the int scalars; the grid in threads. `programmatic`:
    every launch after the first whose kernel waits for its predecessor itself (`Launch.pdl`, built with
    cubin_cache.PDL_PROLOGUE) may start before the previous one ends; the first follows whatever the stream did before
    (a copy) in order."""
    for i, launch in enumerate(launches):
        fn = driver.function(launch.func, launch.cubin)
        args = [c_uint64(where[id(a)]) for a in launch.inputs + launch.outputs]
        blocks = [-(-g // t) for g, t in zip(launch.grid, launch.threadgroup)]
        driver.launch(
            fn,
            blocks,
            launch.threadgroup,
            args + [ctypes.c_int(s) for s in launch.scalars],
            programmatic=programmatic and i > 0 and launch.pdl,
        )


ADDRESS_BATCH = 64  # arrays an address launch reads: always this many (the last one repeated), all of one dtype


@functools.cache
def _address_kernel(ensure_row_contiguous: bool):
    names = [f"x{i}" for i in range(ADDRESS_BATCH)]
    body = (
        "if (threadIdx.x == 0 && blockIdx.x == 0) {\n"
        + "".join(f"  out[{i}] = (unsigned long long)({name});\n" for i, name in enumerate(names))
        + "}\n"
    )
    return cubin_cache.cuda_kernel(
        name=f"mlxcel_addresses_{int(ensure_row_contiguous)}",
        input_names=names,
        output_names=["out"],
        source=body,
        ensure_row_contiguous=ensure_row_contiguous,
    )


def addresses(arrays: list[mx.array], ensure_row_contiguous: bool = False) -> list[int]:
    """Each evaluated array's device address (with its offset), as MLX passes it to a kernel, written out by a kernel
    of ours, 64 arrays of one dtype a launch. With `ensure_row_contiguous`, MLX copies an array it does not count as
    row contiguous first (as our cached kernels' launches do), and that copy's address comes back.

    A kernel variant per dtype, kept in the kernel cache (kernels/cubin_cache.py). Launches of a varying count and mix
    of dtypes would each make MLX compile a new variant (NVRTC) in every process, and a request's first replayed step
    after another request's recording, which asks for one token's address, would be the first to need its variant:
    on the H200 a 1.3-2.5 s stall in such a request's TTFT, against 17 ms with a variant per dtype
    (benchmarks/RESULTS.md)."""
    kernel = _address_kernel(ensure_row_contiguous)
    by_dtype: dict = {}
    for at, array in enumerate(arrays):
        by_dtype.setdefault(array.dtype, []).append(at)
    chunks = [
        positions[start : start + ADDRESS_BATCH]
        for positions in by_dtype.values()
        for start in range(0, len(positions), ADDRESS_BATCH)
    ]
    outs = []
    for chunk in chunks:
        inputs = [arrays[at] for at in chunk]
        inputs += inputs[-1:] * (ADDRESS_BATCH - len(inputs))
        (out,) = kernel(
            inputs=inputs,
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            output_shapes=[(ADDRESS_BATCH,)],
            output_dtypes=[mx.uint64],
        )
        outs.append(out)
    mx.eval(outs)
    found = [0] * len(arrays)
    for chunk, out in zip(chunks, outs):
        for at, address in zip(chunk, out.tolist()):
            found[at] = address
    return found


STEP_DTYPES = (mx.bfloat16, mx.float16, mx.float32, mx.int32, mx.uint32)  # activations, step ints, token, readout


def address_variants(dtypes) -> None:
    """Launch the address kernel once per dtype of `dtypes` and STEP_DTYPES and per copy mode: inside a dry run
    (compile_ahead.py) each missing variant compiles side by side with the rest, where `addresses` would compile it
    at its first use."""
    for dtype in dict.fromkeys([*STEP_DTYPES, *dtypes]):
        for contiguous in (False, True):
            addresses([mx.zeros((1,), dtype)], ensure_row_contiguous=contiguous)

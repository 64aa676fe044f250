"""Timing a CUDA kernel candidate the way a decode step runs it: its chain of launches recorded once through MLX,
captured into one CUDA graph and replayed by the driver, each launch reading a weight no launch in the last
ROTATE_BYTES read.

Why not time the chain through MLX: a decode matvec runs for a few microseconds, while MLX spends tens of
microseconds of host work on each op it evaluates, so an MLX-timed chain measures the host, and the candidates' medians
differ by noise. Why rotate weights: one weight read over and over stays in the L2 cache (50-60 MB on an H100/H200),
where a decode step reads each weight once from memory; a launch configuration fast from L2 need not be fast from
HBM. The engine replays a lone row's decode step as a CUDA graph of these same kernels (backends/cuda/graph_decode.py),
so the replayed chain is what the winner will run in.

Every launch of the chain must be one of our cached kernels (kernels/cubin_cache.py): a kernel compiled by MLX
cannot be replayed, and the cell is then refused with the reason.
"""

from __future__ import annotations

from typing import Callable

# The bytes of distinct weights a chain cycles through: more than any GPU's L2 cache today (a B200 has 126 MB).
ROTATE_BYTES = 256 << 20


def weight_copies(weight_bytes: int, calls: int) -> int:
    """Distinct weight copies a chain of `calls` launches cycles through, so a launch's weight was last read at least
    ROTATE_BYTES earlier (or by the previous replay, when the chain is shorter than that)."""
    return max(1, min(calls, -(-ROTATE_BYTES // max(1, weight_bytes))))


class GraphChains:
    """A driver and the CUDA graphs of one cell's candidates; `close` gives them back."""

    def __init__(self):
        from mlxcel_core.backends.cuda.kernels.cuda_driver import Driver

        self.driver = Driver()
        self.graphs: list = []
        self.kept: list = []  # every recorded array: the graphs read and write their buffers

    def capture(self, chain: Callable[[], object]) -> Callable[[], object]:
        """Record `chain()` (launches of cached kernels only), capture its launches as one graph and return `run`:
        one replay, which returns the last launch's output (zeroed at capture, so a replay that writes nothing
        fails the profiler's check against the default's output)."""
        import mlx.core as mx

        from mlxcel_core.backends.cuda.kernels.cubin_cache import pdl_enabled, record_launches
        from mlxcel_core.backends.cuda.kernels.cuda_driver import addresses, issue_launches

        with record_launches() as launches:
            chain()
        if not launches:
            raise RuntimeError("the candidate launched no cached kernel")
        mlx_made = [i for i, launch in enumerate(launches) if launch.func is None]
        if mlx_made:
            raise RuntimeError(
                f"launch {mlx_made[0]} went to a kernel compiled by MLX, which a CUDA graph cannot replay "
                "(the kernel cache is unusable here: see the warning above)"
            )
        arrays = list({id(a): a for launch in launches for a in launch.inputs + launch.outputs}.values())
        mx.eval(arrays)
        mx.synchronize()
        where = dict(zip(map(id, arrays), addresses(arrays)))
        inputs = list({id(a): a for launch in launches for a in launch.inputs}.values())
        if any(at != where[id(a)] for a, at in zip(inputs, addresses(inputs, ensure_row_contiguous=True))):
            raise RuntimeError("an input of the chain is copied by MLX before its launch: the graph would not read it")
        mx.synchronize()
        driver, out = self.driver, launches[-1].outputs[0]
        exe = driver.capture(lambda: issue_launches(driver, launches, where, programmatic=pdl_enabled()))
        self.graphs.append(exe)
        self.kept.append(arrays)
        driver.fill_zero(where[id(out)], out.nbytes)
        driver.synchronize()

        def run():
            driver.launch_graph(exe)
            return out

        return run

    def sync(self, _output=None) -> None:
        """Wait for the queued replays (the profiler's `sync`)."""
        self.driver.synchronize()

    def close(self) -> None:
        self.driver.synchronize()
        for exe in self.graphs:
            self.driver.destroy_graph(exe)
        self.driver.close()
        self.graphs, self.kept = [], []

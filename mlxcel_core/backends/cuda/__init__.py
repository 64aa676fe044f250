"""The CUDA wing: kernels of our own where MLX runs on a CUDA device (backends.current() picks it there).

It owns its kernels (kernels/: matvecs, fused projections, the greedy readout, the embedding lookup, the final
norm, the kernel cache and the driver calls), the paged decode attention kernel (paged_attention.py), the
decode-step graph (graph_decode.py) and what their inputs must look like (small_arrays.py). Each kernel computes
what MLX's ops compute; tests under tests/mlxcel_core/backends/cuda/ check that on a CUDA machine
(scripts/gpu_suite.sh runs them all there).
"""

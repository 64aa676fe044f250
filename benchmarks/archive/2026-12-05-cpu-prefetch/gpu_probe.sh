#!/usr/bin/env bash
# The kernels part's failure at 777bae3 (gpu_suite_kernels_777bae3.txt): the test alone, its file alone, then worker
# gw0's order in one process. On the device, after the two copy calls:
#   GPU_SUITE_KEEP_CACHE=0 bash scripts/gpu_suite.sh run exec bash benchmarks/archive/2026-12-05-cpu-prefetch/gpu_probe.sh
T=tests/mlxcel_core/backends/cuda/kernels
P="$T/test_fused_projections.py::test_fused_equals_separate_bit_for_bit[1-bfloat16-q4]"
echo "=== the failing test alone"; timeout 120 python -m pytest -q -p no:cacheprovider "$P" 2>&1 | tail -3
echo "=== its file alone"; timeout 150 python -m pytest -q -p no:cacheprovider $T/test_fused_projections.py 2>&1 | tail -3
echo "=== greedy, folds, projections in one process"; timeout 250 python -m pytest -q -x -p no:cacheprovider $T/test_greedy.py $T/test_fused_folds.py $T/test_fused_projections.py 2>&1 | grep -v "^$" | tail -12

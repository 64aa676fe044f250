#!/usr/bin/env bash
# The kernels part's failure at 777bae3 (gpu_suite_kernels_777bae3.txt): the failing test after the two that ran
# before it on worker gw0, the test alone, then the products layer by layer. On the device, after the copy calls:
#   GPU_SUITE_KEEP_CACHE=0 bash scripts/gpu_suite.sh run exec bash benchmarks/archive/2026-12-05-cpu-prefetch/gpu_probe.sh
T=tests/mlxcel_core/backends/cuda/kernels
F="$T/test_fused_projections.py::test_fused_equals_separate_bit_for_bit"
echo "=== float32-q4, bfloat16-plain, then bfloat16-q4 in one process"
timeout 150 python -m pytest -q -p no:cacheprovider "$F[1-float32-q4]" "$F[1-bfloat16-plain]" "$F[1-bfloat16-q4]" 2>&1 | grep -E "passed|failed|Error|^E " | head -8
echo "=== bfloat16-q4 alone"; timeout 100 python -m pytest -q -p no:cacheprovider "$F[1-bfloat16-q4]" 2>&1 | grep -E "passed|failed|^E " | head -5
echo "=== compute-sanitizer: $(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
echo "=== layer by layer"; timeout 100 python benchmarks/archive/2026-12-05-cpu-prefetch/gpu_probe_layers.py 2>&1 | tail -16

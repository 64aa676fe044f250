#!/usr/bin/env bash
# Checks and measurements of mlxcel's CUDA decode path on an H200, one step per device call (each fits a 10-minute
# limit). Run from the repository root after staging MLX (../shared/gpu/README.md; add mlx-lm==0.32.2 to stage.sh's
# package list, or compare_mlx_lm.py and gpu_profile.py have no mlx-lm side), with
#   export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
#   bash benchmarks/h200_kernels.sh STEP [ARGS]
# SHAPE is a --model-shape with its format, e.g. "llama-3.2-1b --dtype bfloat16" or "llama-3-8b --bits 4". A fresh
# machine compiles every kernel in its first run (a minute or more), so a step's first run there can hit the timeouts
# below: run it again. The new figure goes into benchmarks/RESULTS.md, the raw output into a dated section at the end
# of benchmarks/archive/RESULTS-history.md; change a default only where its tests pass and it wins.
#
# The figures of benchmarks/RESULTS.md:
#   defaults          compare_mlx_lm.py on the four shapes (Llama-3.2-1B and Llama-3-8B, bf16 and 4-bit) with the
#                     defaults: 512-token prompt, 128 steps, 2 rounds each; its last line counts the steps replayed
#                     as one CUDA graph, so a silent fallback shows
#   batch SHAPE..     aggregate decode at batch 1, 8, 32 beside mlx-lm's BatchGenerator (batch_decode.py, 3 runs a cell;
#                     an 8B shape's three batches take most of a call)
#   phases            request_phases.py: each request's TTFT and first engine steps on one engine, graph on (with
#                     mlx-lm run between requests, as compare_mlx_lm does, then without) and graph off (--no-graph)
#   families SHAPE..  issue 36's table: 4-bit shapes at batch 1 and 8 beside mlx-lm's BatchGenerator (batch_decode.py,
#                     2 runs a cell, 170 s a shape; default: the shapes whose attention last moved onto the kernel),
#                     then llama-4-scout's batch-1 peer (compare_mlx_lm.py, 3 rounds: BatchGenerator cannot batch it)
#   prompt            a prompt's 4-bit products as 16-bit GEMMs (prefill_products.py), their GPU tests, the 8B 4-bit
#                     TTFT at 512 tokens beside mlx-lm
#   longctx           issue 42's target 5: llama-3.1-8b 4-bit decode and TTFT at a 32k-token context beside mlx-lm
#                     (compare_mlx_lm.py, 2 rounds), then where one decode token's GPU time goes there (mlxcel's side)
#   restart           serve's first request: request_phases.py --serve-warmup in a process that compiles (empty cache
#                     dir) and one that loads (a restart), then serve_coldstart.py cold and warm (1B bf16)
#   cold [SHAPE..]    issue 42's target 6: serve_coldstart.py cold and warm (1B bf16) with a 64-client burst twice
#                     after the two requests, and MLX's JIT modules each run compiled, by name
#   coldstart SHAPE.. the kernel cache: the same `mlxcel bench` in two processes on an empty cache dir; the first
#                     compiles every kernel (warmup_ms), the second should find them all
# Tests on the GPU:
#   tests             the decode kernels' CUDA tests: the 16-bit kernel, the norm and rope folds, MLX workarounds,
#                     the paged-attention kernel's in-kernel KV writes and split combine
#   batching          the batch-routing tests: test_fast_linear.py (4-bit batches by row count), then test_batching.py
#   engine|models|backends  that test directory under tests/mlxcel_core with the GPU defaults, failures named
#                     (backends: every CUDA-backend test, the tensor-core kernel's test_qmm.py among them)
#   graph             the CUDA graph's tests (the plain engine's greedy tokens, replayed), then compare_mlx_lm 1B 4-bit
# A/B runs, beside mlx-lm (compare_mlx_lm) unless `mlxcel bench` is named:
#   portable SHAPE..  each shape with MLXCEL_CUDA=0 (the portable backend: MLX's own ops), then with the CUDA wing
#                     (default shape 1B bf16)
#   graphs SHAPE..    MLX's CUDA graph settings (MLX_USE_CUDA_GRAPHS=0/1, MLX_MAX_OPS_PER_BUFFER 60/200), `mlxcel
#                     bench` only; they apply to the whole process
#   pin SHAPE..       `mlxcel bench` tg128 unpinned and pinned to 4 cores (taskset), 3 times each, alternating: whether
#                     pinning narrows the spread of a host-bound step
#   ab SHAPE..        a change's paired runs: the tree in before/ (made on your machine with
#                     `mkdir before && git archive REF | tar -x -C before`; it is carried because it is untracked;
#                     delete it after) and this tree, alternately, twice, per shape
#   pdlprefetch [tests|ab|ab16|long]  the experiment MLXCEL_PDL_PREFETCH=MiB (the first MiB of a matvec launch's
#                     weight rows, and the paged kernel's first keys and values, asked of L2 before the PDL wait), a
#                     call each: `tests` the CUDA graph's tests, the matvec and paged-attention kernels' with it on
#                     (4 MiB); `ab` tg128 at 0 (off), 2, 8 and 64 MiB (64: every 8B layer's rows whole), alternating,
#                     on 8B 4-bit and 1B 4-bit; `ab16` the same on 8B bf16; `long` 8B 4-bit decode at a 32k-token
#                     context, 0 and 8 MiB, alternating (`mlxcel bench -d 32768`)
#   mmadepth [tests|kernel|long]  the experiment MLXCEL_PAGED_MMA_DEPTH (the paged kernel's tensor-core body with 3 or
#                     4 tiles of keys and values in registers a warp, not 2), a call each: `tests` its tests and the
#                     paged kernel's CUDA tests at depth 4; `kernel` the body alone (paged_kernel.py, 8k and 32k
#                     tokens, 16/32/64 splits) at depths 2, 3, 4, alternating, twice; `long` 8B 4-bit decode at a
#                     32k-token context at depths 2 and 4, alternating (`mlxcel bench -d 32768`)
#   abq SHAPE..       the same pairing with `mlxcel bench` only (tg128 @ d512, 5 reps, three times a tree): a lever's
#                     A/B in a third of ab's time; claims against mlx-lm still come from compare_mlx_lm
# Kernels and profiles:
#   qmmablate         where the 4-bit batch kernel's time goes: qmm_ablate.py (8B fused shapes, 16/32/64 rows)
#   qmmwarps          the 4-bit batch kernel at 8 warps a block against 16 and 4 (groups of 64, 16/32/64 rows), then
#                     against 4 in groups of 32 at 48 and 64 rows, where 8 warps fit one block an SM
#   qmmblocks         the 4-bit batch kernel in groups of 32 at 40, 48 and 64 rows, where it runs one block an SM,
#                     against its registers capped for two (qmm_ablate.py's two_blocks): if two win, delete
#                     qmm.MIN_BLOCKS_WIDE_G32 (every launch two blocks an SM)
#   rows8             where an 8B 4-bit decode batch of 8 rows spends its step: the step's kernels at b=1 and b=8
#                     (gpu_profile.py), the batch kernel at 8, 32 and 64 rows beside it without its dequantization
#                     (qmm_ablate.py), and the matvec kernel at 1 and 8 rows (qmv.py) on the same shapes
#   paged             the paged decode kernel alone (paged_kernel.py, 8B geometry): both bodies at 4k/16k/32k and
#                     their split counts; the tensor-core body at split counts between powers of two that fill more
#                     of one wave (48 x 8 heads = 384 blocks of an H200's 396 at three an SM); then the same body
#                     with registers capped for 4 blocks an SM
#   ggufload [ARGS..] a random llama-3-8b Q4_K GGUF (llama_cpp_peer.py write ARGS) read into MLX layouts twice (the blocks
#                     decoded by MLX ops on the GPU; alternately with the tree in before/ where there is one), then
#                     `mlxcel bench -m` on it: the load's seconds
#   hmv               the 16-bit kernel vs MLX's bf16 GEMV at M = 1 and 2, with its launch-configuration sweep (calls
#                     in sequence on one stream, as a model runs them)
#   sweep             launch configurations measured inside 8B decodes (inmodel_sweep.py: the 16-bit kernel on bf16,
#                     the 4-bit kernel on 4-bit): each mode's GPU time per configuration
#   sweep1b           the same inside the 1B 4-bit decode, with candidates of fewer, fuller blocks
#   attn              the paged-attention launch's GPU time inside 8B and 1B bf16 decodes at 8, 16, 32 splits
#   profile           where a decode token's GPU time goes, mlxcel beside mlx-lm (CUPTI), and by launch shape
#   prefill           where a 512-token prefill's time (TTFT) goes, mlxcel beside mlx-lm, 1B bf16 and 4-bit
#   host              where a 1B decode token's host time goes (graph building, launch, reading, ops per step)
set -u
A="--prompt-tokens 512 --gen-tokens 128"
CUDA_TESTS=tests/mlxcel_core/backends/cuda   # the CUDA backend's tests (kernels/ holds the kernels')
tg128() {
  # SHAPE..: one line, mlxcel's decode speed alone (`mlxcel bench` tg128 @ d512, 5 repetitions) in this directory
  python -m mlxcel_cli bench --model-shape "$@" -p 0 -n 128 -d 512 -r 5 -o jsonl 2>/dev/null | python -c \
    'import json, sys; r = json.loads(sys.stdin.readlines()[-1]); print(r["test"], "%.1f +/- %.1f t/s" % (r["avg_ts"], r["stddev_ts"]))'
}
settings_ab() {
  # "SETTING .." SHAPE..: tg128 under each environment setting, twice each, alternating (default shape 1B bf16)
  local settings=$1; shift
  for what in "${@:-llama-3.2-1b --dtype bfloat16}"; do
    for rep in 1 2; do
      for setting in $settings; do
        echo "== $setting $what: $(export $setting; tg128 $what)"
      done
    done
  done
}
case "${1:-}" in
  prompt)
    # a prompt's 4-bit products: MLX's quantized_matmul against the dequantized weight's 16-bit GEMM, per product and
    # in the model (8B 4-bit, 512-token prompt: TTFT beside mlx-lm), and the fast path's GPU tests
    timeout 200 python benchmarks/prefill_products.py --rows 32,64,128,256,512,2048
    timeout 120 python -m pytest -q -p no:cacheprovider $CUDA_TESTS/kernels/test_fast_linear.py -k prompt -s \
      --timeout 100 --tb=short 2>&1 | tail -4
    timeout 240 python benchmarks/compare_mlx_lm.py --model-shape llama-3-8b --bits 4 --prompt-tokens 512 \
      --gen-tokens 128 --rounds 2 2>&1 | tail -8 ;;
  qmmablate)
    timeout 540 python benchmarks/qmm_ablate.py ;;
  rows8)
    for b in 1 8; do
      timeout 150 python benchmarks/gpu_profile.py --model-shape llama-3-8b --bits 4 --side mlxcel --batch $b --top 12 \
        --warm 4 --tokens 8 2>&1 | grep -vi "warn" | tee "${OUT:-/tmp}/profile_8b_q4_b$b.txt"
    done
    timeout 150 python benchmarks/qmm_ablate.py --variants full no_dequant --rows 8 32 64 \
      --shapes "gate/up fused" down_proj | tee "${OUT:-/tmp}/qmm_rows.txt"
    timeout 100 python benchmarks/qmv.py --m 1 8 --no-sweep --no-e2e --shapes gate/up_proj down_proj \
      | tee "${OUT:-/tmp}/qmv_rows8.txt" ;;
  qmmwarps)
    timeout 300 python benchmarks/qmm_ablate.py --variants full warps16 warps4 | tee "${OUT:-/tmp}/qmm_warps.txt"
    timeout 200 python benchmarks/qmm_ablate.py --variants full warps4 --group-size 32 --rows 48 64 \
      | tee "${OUT:-/tmp}/qmm_warps_g32.txt" ;;
  qmmblocks)
    timeout 200 python benchmarks/qmm_ablate.py --variants full two_blocks --group-size 32 --rows 40 48 64 \
      | tee "${OUT:-/tmp}/qmm_blocks_g32.txt" ;;
  paged)
    export MLX_USE_CUDA_GRAPHS=0
    timeout 200 python benchmarks/paged_kernel.py --splits 16 32 64 128 | tee "${OUT:-/tmp}/paged_kernel.txt"
    timeout 100 python benchmarks/paged_kernel.py --context 8192 32768 --splits 24 32 40 48 --bodies mma \
      | tee "${OUT:-/tmp}/paged_kernel_wave.txt"
    timeout 100 python benchmarks/paged_kernel.py --context 32768 --splits 32 48 64 --bodies mma --min-blocks 4 \
      | tee "${OUT:-/tmp}/paged_kernel_lb4.txt" ;;
  ggufload)
    shift
    args=("$@"); [ ${#args[@]} -gt 0 ] || args=(--model-shape llama-3-8b)
    python benchmarks/llama_cpp_peer.py write --type q4_k "${args[@]}" /tmp/ggufload.gguf
    for rep in 1 2; do
      for tree in before .; do  # (before/: an older tree to compare with, as `ab` takes it)
        [ -d $tree/mlxcel_core ] || continue
        (cd $tree && python -c 'import sys, time; t = time.perf_counter()
from mlxcel_core.loading.gguf_tensors import read_gguf_tensors
tensors, _ = read_gguf_tensors(sys.argv[1])
print(f"read_gguf_tensors ({sys.argv[2]}): {len(tensors)} tensors in {time.perf_counter() - t:.2f} s")' \
          /tmp/ggufload.gguf $tree)
      done
    done
    /usr/bin/time -f "mlxcel bench -m (the whole process: load, warm-up, tg8): %e s" python -m mlxcel_cli bench \
      -m /tmp/ggufload.gguf -p 0 -n 8 -r 1 -o jsonl >/dev/null ;;
  tests)
    timeout 240 python -m pytest -v -p no:cacheprovider $CUDA_TESTS/kernels/test_hmv.py --timeout 100 \
      --tb=short 2>&1 | grep -E "PASS|FAIL|ERROR|^E |passed|failed" | tail -30
    timeout 140 python -m pytest -v -p no:cacheprovider $CUDA_TESTS/kernels/test_fused_folds.py \
      --timeout 100 --tb=short 2>&1 | grep -E "PASS|FAIL|ERROR|^E |passed|failed" | tail -20
    timeout 60 python -m pytest -q -p no:cacheprovider $CUDA_TESTS/kernels/test_mlx_workarounds.py \
      tests/mlxcel_core/test_init.py --timeout 30 --tb=short 2>&1 | tail -5
    timeout 150 python -m pytest -q -p no:cacheprovider $CUDA_TESTS/test_cuda_paged_attention.py \
      -k "keys_and_values or new_kv or one_split or last_block or combine" --timeout 100 --tb=short 2>&1 | tail -5 ;;
  batching)
    # 4-bit batches of up to 8 rows on the matvec kernel, larger ones on the tensor-core kernel (kernels/qmm.py). (All
    # of test_qmv.py, test_qmv_models.py, test_fused_projections.py and test_batching.py do not finish in one call.)
    timeout 150 python -m pytest -q -p no:cacheprovider $CUDA_TESTS/kernels/test_fast_linear.py --tb=short -rf \
      2>&1 | grep -E "^E |FAILED|passed|failed|Fatal"
    echo "exit ${PIPESTATUS[0]}"
    timeout 240 python -m pytest -v -p no:cacheprovider tests/mlxcel_core/engine/test_batching.py --tb=short -rf \
      2>&1 | grep -E "^E |PASS|FAIL|passed|failed|Fatal"
    echo "exit ${PIPESTATUS[0]}" ;;
  batch)
    # SHAPE..: 3 timed runs per (runtime, batch) after a warm-up
    shift
    for what in "${@:-llama-3.2-1b --dtype bfloat16}"; do
      echo "== $what"
      timeout 280 python benchmarks/batch_decode.py --model-shape $what --reps 3 2>&1 | grep -vi "warn" | tail -16
    done ;;
  families)
    shift
    for shape in ${@:-olmo-3-7b gemma-4-e4b gpt-oss-20b}; do
      echo "== $shape"
      timeout 170 python benchmarks/batch_decode.py --model-shape "$shape" --bits 4 --batches 1,8 --reps 2 \
        --no-arch-check 2>&1 | tee "${OUT:-/tmp}/families_$shape.txt" | grep -E "^\| (mlxcel|mlx-lm)"
    done
    timeout 240 python benchmarks/compare_mlx_lm.py --model-shape llama-4-scout --bits 4 $A --rounds 3 2>&1 \
      | tee "${OUT:-/tmp}/families_llama-4-scout.txt" | tail -8 ;;
  longctx)
    timeout 360 python benchmarks/compare_mlx_lm.py --model-shape llama-3.1-8b --bits 4 --prompt-tokens 32768 \
      --gen-tokens 128 --rounds 2 2>&1 | tee "${OUT:-/tmp}/longctx_compare.txt" | tail -8
    timeout 200 python benchmarks/gpu_profile.py --model-shape llama-3.1-8b --bits 4 --prompt-tokens 32768 \
      --side mlxcel --top 12 --shapes 2>&1 | grep -vi "warn" | tee "${OUT:-/tmp}/longctx_profile.txt" ;;
  restart)
    # serve's first request: serve's warm-up on a throwaway engine, then each request on a new engine (as serve does),
    # in a process that compiles every kernel (empty cache dir) and one that loads them (a restart); then `mlxcel
    # serve` itself, cold and warm (serve_coldstart.py makes its own empty cache dir)
    export MLXCEL_CACHE_DIR=$(mktemp -d)
    for p in cold warm; do
      echo "== process $p $(date +%T)"
      timeout 200 python benchmarks/request_phases.py --model-shape llama-3.2-1b --dtype bfloat16 --prompt-tokens 5 \
        --gen-tokens 200 --requests 2 --steps 3 --serve-warmup --max-batch 4 2>&1 | grep -v "^\s*$"
    done
    unset MLXCEL_CACHE_DIR
    echo "== serve_coldstart $(date +%T)"
    timeout 300 python benchmarks/serve_coldstart.py --model-shape llama-3.2-1b --dtype bfloat16 --max-tokens 64 \
      --runs cold,warm 2>&1 | tail -3 ;;
  cold)
    shift  # SHAPE.. (default 1B bf16, the results page's row): another family's MLX modules show in --jit-names
    timeout 500 python benchmarks/serve_coldstart.py --model-shape ${@:-llama-3.2-1b --dtype bfloat16} --max-tokens 64 \
      --runs cold,warm --burst 64 --max-batch-size 64 --jit-names 2>&1 | tee "${OUT:-/tmp}/serve_coldstart.txt" ;;
  coldstart)
    # SHAPE..: the kernel cache (paths.use_kernel_cache: $MLXCEL_CACHE_DIR/kernels/...): an empty cache dir, then the
    # same bench in two processes; the first warm-up compiles every kernel, the second should find them (warmup_ms)
    shift
    export MLXCEL_CACHE_DIR=$(mktemp -d)
    for run in 1 2; do
      echo "== process $run $(date +%T)"
      timeout 250 python -m mlxcel_cli bench --model-shape ${@:-llama-3-8b --bits 4} -p 512 -n 32 -r 1 -o jsonl \
        2>/dev/null | python -c 'import json, sys
for line in sys.stdin:
    r = json.loads(line); print(r["test"], "warm-up %.0f ms," % r["warmup_ms"], "%.1f t/s" % r["avg_ts"])'
    done
    echo "kernels cached: $(find "$MLXCEL_CACHE_DIR/kernels" -type f | wc -l) files in $(ls "$MLXCEL_CACHE_DIR/kernels"/*)" ;;
  hmv)
    timeout 280 python benchmarks/hmv.py --m 1 2 --reps 9 ;;
  sweep)
    timeout 280 python benchmarks/inmodel_sweep.py --model-shape llama-3-8b --dtype bfloat16 2>&1 | grep -vi "warn"
    timeout 280 python benchmarks/inmodel_sweep.py --model-shape llama-3-8b --bits 4 2>&1 | grep -vi "warn" ;;
  sweep1b)
    # The 1B 4-bit step: launch_config's rule gives it 1-warp blocks of 4 rows, 128 registers a thread, about two
    # waves of blocks. Candidates with fewer, fuller blocks or both rounds of K in flight:
    timeout 280 python benchmarks/inmodel_sweep.py --model-shape llama-3.2-1b --bits 4 --configs 4,1,1 8,1,1 8,2,1 \
      4,2,1 4,1,2 8,1,2 2,2,1 4,4,1 2>&1 | grep -vi "warn" ;;
  pdlprefetch)
    case "${2:-tests}" in
      tests)
        MLXCEL_PDL_PREFETCH=4 timeout 500 python -m pytest -q -p no:cacheprovider -n 8 \
          $CUDA_TESTS/test_graph_decode.py $CUDA_TESTS/test_cuda_paged_attention.py $CUDA_TESTS/kernels/test_qmv.py \
          $CUDA_TESTS/kernels/test_hmv.py --tb=short -rf 2>&1 | grep -E "^E |FAILED|passed|failed|Fatal|Error" ;;
      ab)
        settings_ab "MLXCEL_PDL_PREFETCH=0 MLXCEL_PDL_PREFETCH=2 MLXCEL_PDL_PREFETCH=8 MLXCEL_PDL_PREFETCH=64" \
          "llama-3-8b --bits 4" "llama-3.2-1b --bits 4" ;;
      ab16)
        settings_ab "MLXCEL_PDL_PREFETCH=0 MLXCEL_PDL_PREFETCH=2 MLXCEL_PDL_PREFETCH=8 MLXCEL_PDL_PREFETCH=64" \
          "llama-3-8b --dtype bfloat16" ;;
      long)
        for rep in 1 2; do
          for on in 0 8; do
            echo "== MLXCEL_PDL_PREFETCH=$on 8B 4-bit @ d32768: $(MLXCEL_PDL_PREFETCH=$on python -m mlxcel_cli bench \
              --model-shape llama-3.1-8b --bits 4 -p 0 -n 64 -d 32768 -r 2 -o jsonl 2>/dev/null | tail -1)"
          done
        done ;;
    esac ;;
  mmadepth)
    case "${2:-tests}" in
      tests)
        timeout 200 python -m pytest -q -p no:cacheprovider -n 4 $CUDA_TESTS/test_paged_attention_depth.py \
          $CUDA_TESTS/test_paged_attention_mma.py --tb=short -rf 2>&1 | grep -E "^E |FAILED|passed|failed|Error"
        MLXCEL_PAGED_MMA_DEPTH=4 timeout 300 python -m pytest -q -p no:cacheprovider -n 8 \
          $CUDA_TESTS/test_cuda_paged_attention.py $CUDA_TESTS/test_cuda_paged_attention_limits.py --tb=short -rf \
          2>&1 | grep -E "^E |FAILED|passed|failed|Error" ;;
      kernel)
        export MLX_USE_CUDA_GRAPHS=0
        for rep in 1 2; do
          for depth in 2 3 4; do
            echo "== MLXCEL_PAGED_MMA_DEPTH=$depth (round $rep)"
            MLXCEL_PAGED_MMA_DEPTH=$depth timeout 120 python benchmarks/paged_kernel.py --context 8192 32768 \
              --splits 16 32 64 --bodies mma --reps 5
          done
        done 2>&1 | tee "${OUT:-/tmp}/paged_mma_depth.txt" ;;
      long)
        for rep in 1 2; do
          for depth in 2 4; do
            echo "== MLXCEL_PAGED_MMA_DEPTH=$depth 8B 4-bit @ d32768: $(MLXCEL_PAGED_MMA_DEPTH=$depth python -m \
              mlxcel_cli bench --model-shape llama-3.1-8b --bits 4 -p 0 -n 64 -d 32768 -r 2 -o jsonl 2>/dev/null \
              | tail -1)"
          done
        done ;;
    esac ;;
  graph)
    # on a fresh machine these tests spend about 3 minutes compiling kernels and building the 1B model twice
    timeout 380 python -m pytest -q -p no:cacheprovider $CUDA_TESTS/test_graph_decode.py --tb=short -rf \
      2>&1 | grep -E "^E |FAILED|passed|failed|Fatal|Error"
    timeout 180 python benchmarks/compare_mlx_lm.py --model-shape llama-3.2-1b --bits 4 $A \
      --rounds 2 2>&1 | grep -E "round|median decode|graph|Error" ;;
  defaults)
    for what in "llama-3.2-1b --dtype bfloat16" "llama-3.2-1b --bits 4" "llama-3-8b --bits 4" \
                "llama-3-8b --dtype bfloat16"; do
      echo "== $what"
      timeout 140 python benchmarks/compare_mlx_lm.py --model-shape $what $A --rounds 2 2>&1 \
        | grep -E "round|median decode|CUDA graph|Error"
    done ;;
  phases)
    # compare_mlx_lm's order (mlx-lm between requests), then without mlx-lm, then MLX's steps only (graph off)
    for run in "--mlx-lm-between" "" "--no-graph --mlx-lm-between"; do
      echo "== request_phases ${run:-(graph on, no mlx-lm)}"
      timeout 150 python benchmarks/request_phases.py --model-shape llama-3.2-1b --dtype bfloat16 --requests 4 \
        $run 2>&1 | grep -v "^\s*$"
    done ;;
  portable)
    # SHAPE..: compare_mlx_lm per shape on the portable backend (MLXCEL_CUDA=0: MLX's own ops), then the CUDA wing
    shift
    for what in "${@:-llama-3.2-1b --dtype bfloat16}"; do
      for cuda in 0 1; do
        echo "== MLXCEL_CUDA=$cuda $what"
        MLXCEL_CUDA=$cuda timeout 140 python benchmarks/compare_mlx_lm.py --model-shape $what $A --rounds 2 2>&1 \
          | grep -E "round|median decode|backend|Error"
      done
    done ;;
  attn)
    # the attention launch's GPU time inside the decode at split counts 8, 16, 32 (8B and 1B bf16)
    for shape in llama-3-8b llama-3.2-1b; do
      for s in 8 16 32; do
        echo "== $shape S=$s"
        MLXCEL_PAGED_DECODE_SPLITS=$s timeout 80 python benchmarks/gpu_profile.py --model-shape $shape --dtype bfloat16 \
          --side mlxcel --top 6 --warm 6 --tokens 12 2>&1 | grep -E "wall|paged_decode"
      done
    done ;;
  profile)
    for shape in "llama-3.2-1b" "llama-3-8b"; do
      timeout 140 python benchmarks/gpu_profile.py --model-shape $shape --top 12 --shapes 2>&1 | grep -vi "warn"
    done ;;
  prefill)
    for what in "--dtype bfloat16" "--bits 4"; do
      timeout 200 python benchmarks/gpu_profile.py --model-shape llama-3.2-1b $what --prefill --warm 3 --tokens 8 \
        --top 14 2>&1 | grep -vi "warn"
    done ;;
  host)
    for what in "--dtype bfloat16" "--bits 4"; do
      timeout 140 python benchmarks/host_profile.py --model-shape llama-3.2-1b $what --top 16 2>&1 | grep -vi "warn"
    done ;;
  engine|models|backends)
    # -rf: the failures by name (the whole list of these directories does not fit one call's output or 10 minutes).
    # --timeout 120: on a fresh machine the CUDA graph's test spends over 60 s compiling
    timeout 580 python -m pytest -q -p no:cacheprovider tests/mlxcel_core/$1 --timeout 120 --tb=line -rf 2>&1 \
      | grep -vE "^\s*$|Writing model shards" | tail -60 ;;
  ab)
    shift
    [ -d before ] || { echo "ab: no before/ tree (see the usage above)" >&2; exit 2; }
    for what in "${@:-llama-3.2-1b --dtype bfloat16}"; do
      for tree in before . before .; do
        echo "== ${tree/./after} $what"
        (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 100 python benchmarks/compare_mlx_lm.py --model-shape $what $A \
          --rounds 2 2>&1 | grep -E "round|median decode")
      done
    done ;;
  abq)
    shift
    [ -d before ] || { echo "abq: no before/ tree (see the usage above)" >&2; exit 2; }
    for what in "${@:-llama-3.2-1b --dtype bfloat16}"; do
      for tree in before . before . before .; do
        echo "== ${tree/./after} $what: $(cd $tree && PYTHONPATH=/tmp/site:$PWD tg128 $what)"
      done
    done ;;
  pin)
    shift
    nproc; numactl --hardware 2>/dev/null | head -3
    cores=$(python -c 'import os; c = sorted(os.sched_getaffinity(0)); print(",".join(map(str, c[:4])))')
    for what in "${@:-llama-3.2-1b --bits 4}"; do
      for rep in 1 2 3; do
        echo "== unpinned $what: $(tg128 $what)"
        echo "== taskset -c $cores $what: $(taskset -c $cores bash -c "$(declare -f tg128); tg128 $what")"
      done
    done ;;
  graphs)
    # MLX's CUDA graph settings (they apply to the whole process)
    shift
    settings_ab "MLX_USE_CUDA_GRAPHS=1 MLX_USE_CUDA_GRAPHS=0 MLX_MAX_OPS_PER_BUFFER=60 MLX_MAX_OPS_PER_BUFFER=200" "$@" ;;
  *)
    echo "usage: bash benchmarks/h200_kernels.sh STEP [ARGS], STEP one of defaults batch phases restart coldstart" \
      "tests batching engine models backends graph portable graphs pin ab abq hmv sweep sweep1b attn profile" \
      "prefill host (the header says what each does)" >&2
    exit 2 ;;
esac

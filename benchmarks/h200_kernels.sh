#!/usr/bin/env bash
# The H200 checks of the decode kernels (MLXCEL_HMV, MLXCEL_FUSE_NORM, MLXCEL_FUSE_ROPE, ...), one step per device
# call (each fits the 10-minute limit): run from the project root after staging MLX (../shared/gpu/README.md; add
# mlx-lm==0.32.2 to stage.sh's package list, or compare_mlx_lm.py and gpu_profile.py's mlx-lm side have no mlx_lm), with
#   export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
#   bash benchmarks/h200_kernels.sh tests      # their CUDA tests (the kernels' accuracy, modes, model decode)
#   bash benchmarks/h200_kernels.sh changed    # the tests of what the fifteenth session changed (4-bit batches of up
#                                              # to 8 rows on the kernel, larger ones as one matrix)
#   bash benchmarks/h200_kernels.sh rows       # kernels/qmm.py's tests, then MLXCEL_QMM_BATCH=chunks and matrix at an
#                                              # 8B 4-bit batch of 32 (mma, the default, gave 1094 tok/s and mlx 300;
#                                              # these two did not finish in 115 s in the sixteenth session)
#   bash benchmarks/h200_kernels.sh coldstart SHAPE.. # the kernel cache under $MLXCEL_CACHE_DIR: a first process
#                                              # compiles (warmup_ms), a second should not (not run itself; `restart`
#                                              # measured the same in the eighteenth session)
#   bash benchmarks/h200_kernels.sh restart    # startup_phases.py in three processes on one empty cache dir, then
#                                              # serve_coldstart.py (1B 4-bit; eighteenth session: 56 s, then 2.3 s
#                                              # and 1.7 s a process with the cubin cache; serve ready in 2.2 s)
#   bash benchmarks/h200_kernels.sh qmm        # those ways one product at a time (benchmarks/qmm_batch.py), with
#                                              # qmm.py's two load layouts (MLXCEL_QMM_WIDE=0/1)
#   bash benchmarks/h200_kernels.sh hmv8       # the 16-bit kernel's tests at 8 rows (passed, seventeenth session: 8 rows
#                                              # are the default up to 2048 wide), then MLXCEL_HMV_MAX_ROWS 2 vs 8
#   bash benchmarks/h200_kernels.sh together   # the engine's prefill-together tests (passed on the H200 in the
#                                              # eighteenth session; the default there), then batch TTFT with
#                                              # MLXCEL_PREFILL_BATCH=8 vs 1, 1B bf16 and 8B 4-bit at b=8 and 32
#   bash benchmarks/h200_kernels.sh wide       # qmm.py's tests (both layouts), then an 8B 4-bit batch of 32 with
#                                              # MLXCEL_QMM_WIDE=0 and 1, alternating (mlxcel only). On a fresh machine
#                                              # the tests and the first two runs need more than 150 s each (compiles)
#   bash benchmarks/h200_kernels.sh hmv        # the 16-bit kernel vs MLX's bf16 GEMV, M = 1 and 2, with the sweep
#                                              # (calls in sequence on one stream, as a model runs them)
#   bash benchmarks/h200_kernels.sh blocks     # a decode layer's blocks, MLX vs the 16-bit kernel (which one loses at 8B)
#   bash benchmarks/h200_kernels.sh sweep      # launch configurations inside 8B decodes (16-bit kernel on bf16, 4-bit
#                                              # kernel on 4-bit): each mode's GPU time per configuration
#   bash benchmarks/h200_kernels.sh sweep1b    # the same for the 1B 4-bit decode (not yet run): the unmet 2x target
#   bash benchmarks/h200_kernels.sh graph      # the CUDA graph (engine/graph_decode.py, on by default): its GPU tests (the
#                                              # plain engine's greedy tokens, replaying), then compare_mlx_lm 1B 4-bit
#   bash benchmarks/h200_kernels.sh defaults   # compare_mlx_lm on the four shapes with the defaults, 2 rounds each (one
#                                              # engine per script run since 7eef2af; its last line: the graph's steps)
#   bash benchmarks/h200_kernels.sh pdl        # programmatic dependent launch (MLXCEL_GRAPH_PDL, on by default from
#                                              # sm_90 since the twenty-second session: +5% at 1B 4-bit): the graph's
#                                              # GPU tests with it, then 1B bf16 and 4-bit with it off and on
#   bash benchmarks/h200_kernels.sh phases     # request_phases.py: each request's TTFT and first steps on one engine,
#                                              # graph on then off (compare_mlx_lm's first timed run read 1.3-2.5 s of
#                                              # TTFT in the twenty-second session; since b745c9d request 2 reads
#                                              # 17 ms, twenty-third session)
#   bash benchmarks/h200_kernels.sh kv SHAPE.. # compare_mlx_lm per shape (default "llama-3-8b --dtype bfloat16";
#                                              # two shapes fit a call), KV written by scatter ops
#                                              # (MLXCEL_KV_IN_KERNEL=0) then by the attention kernel (the default)
#   bash benchmarks/h200_kernels.sh gate VAR SHAPE.. # the same A/B for any 0/1 switch (MLXCEL_COMBINE_IN_KERNEL, ...)
#   bash benchmarks/h200_kernels.sh attn       # the paged-attention launch's time in 8B/1B decodes at 8, 16, 32 splits
#   bash benchmarks/h200_kernels.sh bf16       # compare_mlx_lm, bf16 shapes, MLXCEL_HMV off then on
#   bash benchmarks/h200_kernels.sh q4         # compare_mlx_lm, 1B 4-bit, the norm and rope folds off then on
#   bash benchmarks/h200_kernels.sh folds      # 1B bf16 and 4-bit, 8B 4-bit: norm+rope folds off then on (fewer
#                                              # launches a layer: the 1B step is host-bound)
#   bash benchmarks/h200_kernels.sh profile    # where a decode token's GPU time goes, mlxcel vs mlx-lm (CUPTI), and
#                                              # by launch shape (grid, block, registers, achieved occupancy)
#   bash benchmarks/h200_kernels.sh prefill    # where a 512-token prefill's time goes (TTFT), mlxcel vs mlx-lm, 1B bf16
#                                              # and 4-bit (the 1B bf16 TTFT was above mlx-lm's, thirteenth session)
#   bash benchmarks/h200_kernels.sh graphs SHAPE.. # MLX's CUDA graph settings (MLX_USE_CUDA_GRAPHS=0/1,
#                                              # MLX_MAX_OPS_PER_BUFFER 60/200), mlxcel bench only: with 88 launches a
#                                              # 1B step (573 ops when last swept) the best setting may differ
#   bash benchmarks/h200_kernels.sh pin SHAPE.. # the same tg128 unpinned and pinned to 4 cores of one NUMA node
#                                              # (taskset), 3 times each, alternating: the 1B step is host-bound and
#                                              # one setting read 535 and 701 tok/s in two processes (fourteenth
#                                              # session); if pinning narrows that, A/Bs of host-side levers can resolve
#   bash benchmarks/h200_kernels.sh barrier    # three chained 1B-shaped matvecs: three launches vs one persistent
#                                              # launch with grid barriers (grid_barrier.py; does fewer launches pay?)
#   bash benchmarks/h200_kernels.sh host       # where its host time goes (graph building, launch, ops per step)
#   bash benchmarks/h200_kernels.sh depth      # 1, 2, 4 decode steps per async_eval (a probe of the launch cost)
#   bash benchmarks/h200_kernels.sh launch SHAPE.. # the engine's launcher thread (MLXCEL_LAUNCH_THREAD=1: step k
#                                              # handed to MLX while step k + 1 is built): its tests, then off / on,
#                                              # mlxcel bench only
#   bash benchmarks/h200_kernels.sh batch SHAPE.. # batch 1, 8, 32 aggregate decode beside mlx-lm's BatchGenerator
#                                              # (batch_decode.py; last measured on the H200 in the first session)
#   bash benchmarks/h200_kernels.sh engine     # the engine tests with the GPU defaults, failures named
#   bash benchmarks/h200_kernels.sh models     # the model-family tests (transformers parity, 4-bit copies) there
#   bash benchmarks/h200_kernels.sh ab SHAPE.. # a change's paired runs: the tree in before/ (made on your machine
#                                              # with `mkdir before && git archive REF | tar -x -C before`; it is
#                                              # carried because it is untracked; delete it after) and this tree,
#                                              # alternately, twice, per shape (e.g. "llama-3.2-1b --dtype bfloat16")
#   bash benchmarks/h200_kernels.sh abq SHAPE.. # the same pairing, mlxcel only (`mlxcel bench` tg128 @ d512, 5 reps,
#                                              # three times a tree): a lever's A/B in a third of ab's time; claims
#                                              # against mlx-lm still come from compare_mlx_lm
# Commit what they print to benchmarks/RESULTS.md; flip a default only where its tests pass and it wins.
set -u
A="--prompt-tokens 512 --gen-tokens 128"
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
  tests)
    timeout 240 python -m pytest -v -p no:cacheprovider tests/mlxcel_core/kernels/test_hmv.py --timeout 100 \
      --tb=short 2>&1 | grep -E "PASS|FAIL|ERROR|^E |passed|failed" | tail -30
    timeout 140 python -m pytest -v -p no:cacheprovider tests/mlxcel_core/kernels/test_fused_folds.py \
      --timeout 100 --tb=short 2>&1 | grep -E "PASS|FAIL|ERROR|^E |passed|failed" | tail -20
    timeout 60 python -m pytest -q -p no:cacheprovider tests/mlxcel_core/kernels/test_mlx_workarounds.py \
      tests/mlxcel_core/test_init.py --timeout 30 --tb=short 2>&1 | tail -5
    timeout 150 python -m pytest -q -p no:cacheprovider tests/mlxcel_core/kv/test_cuda_paged_attention.py \
      -k "keys_and_values or new_kv or one_split or last_block or combined_in" --timeout 100 --tb=short 2>&1 | tail -5 ;;
  changed)
    # the fifteenth session's: 4-bit batches of up to 8 rows on the kernel, larger ones by MLXCEL_QMM_BATCH. (All of
    # test_qmv.py, test_qmv_models.py, test_fused_projections.py and test_batching.py did not finish in 420 s.)
    timeout 150 python -m pytest -q -p no:cacheprovider tests/mlxcel_core/kernels/test_fast_linear.py --tb=short -rf \
      2>&1 | grep -E "^E |FAILED|passed|failed|Fatal"
    echo "exit ${PIPESTATUS[0]}"
    timeout 240 python -m pytest -v -p no:cacheprovider tests/mlxcel_core/engine/test_batching.py --tb=short -rf \
      2>&1 | grep -E "^E |PASS|FAIL|passed|failed|Fatal"
    echo "exit ${PIPESTATUS[0]}" ;;
  batch)
    # SHAPE..: 3 timed runs per (runtime, batch); an 8B shape's three batches take most of a call
    shift
    for what in "${@:-llama-3.2-1b --dtype bfloat16}"; do
      echo "== $what"
      timeout 280 python benchmarks/batch_decode.py --model-shape $what --reps 3 2>&1 | grep -vi "warn" | tail -16
    done ;;
  rows)
    # first kernels/qmm.py's tests, then MLXCEL_QMM_BATCH=mma / chunks / matrix / mlx at an 8B 4-bit batch of 32
    # (mlxcel only). On a fresh machine each run spends ~70 s compiling kernels before its warm-up ends: "mma" and
    # "mlx" took 104-109 s, "matrix" and "chunks" did not finish in 115 s (sixteenth session), hence 150 s here; each
    # line is timestamped, so a stall shows where it was
    timeout 100 python -m pytest -q -p no:cacheprovider tests/mlxcel_core/kernels/test_qmm.py --tb=short -rf 2>&1 \
      | grep -E "^E |FAILED|passed|failed|Fatal"
    for mode in chunks matrix; do
      echo "== MLXCEL_QMM_BATCH=$mode $(date +%T)"
      MLXCEL_QMM_BATCH=$mode timeout 150 python benchmarks/batch_decode.py --model-shape llama-3-8b --bits 4 \
        --batches 32 --reps 1 --no-mlx-lm 2>&1 | tr '\r' '\n' | grep -vi warn \
        | while IFS= read -r line; do echo "$(date +%T) $line"; done
      echo "exit ${PIPESTATUS[0]} $(date +%T)"
    done ;;
  hmv8)
    timeout 240 python -m pytest -q -p no:cacheprovider tests/mlxcel_core/kernels/test_hmv.py --tb=short -rf \
      -k "test_modes or eight_rows or matches_float64" 2>&1 | grep -E "^E |FAILED|passed|failed|Fatal"
    for r in 2 8 2 8; do
      echo "== MLXCEL_HMV_MAX_ROWS=$r $(date +%T): $(MLXCEL_HMV_MAX_ROWS=$r timeout 100 python \
        benchmarks/batch_decode.py --model-shape llama-3.2-1b --dtype bfloat16 --batches 8 --reps 1 --no-mlx-lm 2>&1 \
        | grep "run 1/1")"
    done ;;
  together)
    timeout 300 python -m pytest -q -p no:cacheprovider tests/mlxcel_core/engine/test_batching.py --tb=short -rf \
      -k "together or prefill_batch" tests/mlxcel_core/engine/test_prefill_together_families.py 2>&1 \
      | grep -E "^E |FAILED|passed|failed|Fatal"
    for what in "llama-3.2-1b --dtype bfloat16" "llama-3-8b --bits 4"; do
      for v in 1 8 1 8; do
        echo "== MLXCEL_PREFILL_BATCH=$v $what $(date +%T)"
        MLXCEL_PREFILL_BATCH=$v timeout 150 python benchmarks/batch_decode.py --model-shape $what --batches 8,32 \
          --reps 1 --no-mlx-lm 2>&1 | grep "^| mlxcel"
      done
    done ;;
  wide)
    # MLXCEL_QMM_WIDE (vector loads in kernels/qmm.py; on by default since the seventeenth session's run): its tests,
    # then end to end. The first run compiles (~70 s on a fresh machine), so it is a warm-up; timestamps show a stall
    timeout 280 python -m pytest -q -p no:cacheprovider tests/mlxcel_core/kernels/test_qmm.py --tb=short -rf 2>&1 \
      | grep -E "^E |FAILED|passed|failed|Fatal"
    for wide in 1 0 1 0; do
      echo "== MLXCEL_QMM_WIDE=$wide $(date +%T): $(MLXCEL_QMM_WIDE=$wide timeout 150 python benchmarks/batch_decode.py \
        --model-shape llama-3-8b --bits 4 --batches 32 --reps 1 --no-mlx-lm 2>&1 | grep "run 1/1")"
    done ;;
  restart)
    export MLXCEL_CACHE_DIR=$(mktemp -d)
    python -c "import sys; sys.path.insert(0, 'benchmarks')
from pathlib import Path; from serve_coldstart import save_model
save_model('llama-3.2-1b', 4, 'bfloat16', Path('$MLXCEL_CACHE_DIR/model'))"
    for p in 1 2 3; do
      echo "== process $p $(date +%T)"
      timeout 150 python benchmarks/startup_phases.py "$MLXCEL_CACHE_DIR/model" 2>&1 | grep -E "step|total|rror"
    done
    unset MLXCEL_CACHE_DIR
    timeout 200 python benchmarks/serve_coldstart.py --model-shape llama-3.2-1b --bits 4 2>&1 | tail -4 ;;
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
  qmm)
    # the batch products one at a time: MLX, MLX as one matrix, dequantize + matmul, the matvec kernel in 8-row
    # launches, kernels/qmm.py (with its difference from MLX's result)
    timeout 300 python benchmarks/qmm_batch.py --m 1 8 9 16 32 2>&1 | grep -vi warn ;;
  hmv)
    timeout 280 python benchmarks/hmv.py --m 1 2 --reps 9 ;;
  blocks)
    for shape in "llama-3-8b" "llama-3.2-1b"; do
      timeout 280 python benchmarks/decode_blocks.py --model-shape $shape --m 1 2
    done ;;
  sweep)
    timeout 280 python benchmarks/inmodel_sweep.py --model-shape llama-3-8b --dtype bfloat16 2>&1 | grep -vi "warn"
    timeout 280 python benchmarks/inmodel_sweep.py --model-shape llama-3-8b --bits 4 2>&1 | grep -vi "warn" ;;
  sweep1b)
    # The 1B 4-bit step (host-bound, and its kernels far from the roofline: gate/up + SwiGLU 14.8 us a layer for 9.4 MB
    # in the twelfth session's profile). launch_config's rule gives it 1-warp blocks of 4 rows, 128 registers a
    # thread: about two waves of blocks. Candidates with fewer, fuller blocks or both rounds of K in flight:
    timeout 280 python benchmarks/inmodel_sweep.py --model-shape llama-3.2-1b --bits 4 --configs 4,1,1 8,1,1 8,2,1 \
      4,2,1 4,1,2 8,1,2 2,2,1 4,4,1 2>&1 | grep -vi "warn" ;;
  graph)
    # a fresh machine spent 180 s in these tests (kernel compiles, the 1B model built twice): the first call needs
    # the whole 10 minutes
    timeout 380 python -m pytest -q -p no:cacheprovider tests/mlxcel_core/engine/test_graph_decode.py --tb=short -rf \
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
  pdl)
    MLXCEL_GRAPH_PDL=1 timeout 300 python -m pytest -q -p no:cacheprovider -k cuda_graph --tb=short -rf \
      tests/mlxcel_core/engine/test_graph_decode.py 2>&1 | grep -E "^E |FAILED|passed|failed|Fatal|Error"
    bash "$0" gate MLXCEL_GRAPH_PDL "llama-3.2-1b --dtype bfloat16" "llama-3.2-1b --bits 4" ;;
  phases)
    # compare_mlx_lm's order (mlx-lm between), then without mlx-lm, then the graph off
    for run in "1 --mlx-lm-between" "1" "0 --mlx-lm-between"; do
      set -- $run
      echo "== MLXCEL_CUDA_GRAPH=$run"
      MLXCEL_CUDA_GRAPH=$1 timeout 150 python benchmarks/request_phases.py --model-shape llama-3.2-1b \
        --dtype bfloat16 --requests 4 ${2:-} 2>&1 | grep -v "^\s*$"
    done ;;
  kv)
    shift
    bash "$0" gate MLXCEL_KV_IN_KERNEL "${@:-llama-3-8b --dtype bfloat16}" ;;
  gate)
    # gate VAR SHAPE..: compare_mlx_lm per shape with VAR=0, then VAR=1 (e.g. MLXCEL_COMBINE_IN_KERNEL)
    shift; var=$1; shift
    for what in "${@:-llama-3.2-1b --dtype bfloat16}"; do
      for gate in "$var=0" "$var=1"; do
        echo "== $gate $what"
        env $gate timeout 110 python benchmarks/compare_mlx_lm.py --model-shape $what $A --rounds 2 2>&1 \
          | grep -E "round|median decode"
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
  bf16)
    for gate in "MLXCEL_HMV=0" "MLXCEL_HMV=1"; do
      for shape in "llama-3.2-1b" "llama-3-8b"; do
        echo "== $gate $shape bf16"
        env $gate timeout 110 python benchmarks/compare_mlx_lm.py --model-shape $shape --dtype bfloat16 $A \
          --rounds 2 2>&1 | grep -E "round|median|kernel"
      done
    done ;;
  q4)
    for gate in "MLXCEL_FUSE_NORM=0" "MLXCEL_FUSE_NORM=1" "MLXCEL_FUSE_ROPE=1" "MLXCEL_FUSE_NORM=1 MLXCEL_FUSE_ROPE=1"; do
      echo "== $gate llama-3.2-1b 4-bit"
      env $gate timeout 120 python benchmarks/compare_mlx_lm.py --model-shape llama-3.2-1b --bits 4 $A --rounds 3 \
        2>&1 | grep -E "round|median|kernel"
    done ;;
  folds)
    for what in "llama-3.2-1b --dtype bfloat16 --rounds 3" "llama-3.2-1b --bits 4 --rounds 3" \
                "llama-3-8b --bits 4 --rounds 2"; do
      for gate in "MLXCEL_FUSE_NORM=0 MLXCEL_FUSE_ROPE=0" "MLXCEL_FUSE_NORM=1 MLXCEL_FUSE_ROPE=1"; do
        echo "== $gate $what"
        env $gate timeout 110 python benchmarks/compare_mlx_lm.py --model-shape $what $A 2>&1 \
          | grep -E "round|median decode"
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
  depth)
    for what in "--dtype bfloat16" "--bits 4"; do
      timeout 200 python benchmarks/decode_depth.py --model-shape llama-3.2-1b $what --rounds 3 2>&1 | grep -vi "warn"
    done ;;
  launch)
    # the engine's launcher thread (MLXCEL_LAUNCH_THREAD) off / on, mlxcel bench only, twice each, alternating;
    # then `gate MLXCEL_LAUNCH_THREAD SHAPE` for the record against mlx-lm where it wins
    shift
    timeout 120 python -m pytest -q -p no:cacheprovider tests/mlxcel_core/engine/test_launcher.py --timeout 60 \
      --tb=short 2>&1 | grep -E "^E |passed|failed|Fatal" | tail -8
    settings_ab "MLXCEL_LAUNCH_THREAD=0 MLXCEL_LAUNCH_THREAD=1" "$@" ;;
  engine|models)
    # -rf: the failures by name (the whole list of both directories does not fit one call's output or 10 minutes).
    # --timeout 120: on a fresh machine the CUDA graph's test spent over 60 s compiling (twenty-first session)
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
  barrier)
    timeout 120 python benchmarks/grid_barrier.py 2>&1 | grep -vi "warn"
    timeout 120 python benchmarks/grid_barrier.py --blocks 66 2>&1 | grep -vi "warn" | tail -1
    # tiny stages: the host's cost per launch and the barrier's, with next to no GPU work
    timeout 120 python benchmarks/grid_barrier.py --hidden 256 --intermediate 512 2>&1 | grep -vi "warn" | tail -1 ;;
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
    echo "usage: bash benchmarks/h200_kernels.sh tests|changed|rows|qmm|batch|pin|barrier|hmv|blocks|sweep|kv|gate|attn|bf16|q4|folds|profile|prefill|host|depth|launch|engine|models|ab|abq|graphs" >&2
    exit 2 ;;
esac

#!/usr/bin/env bash
# The whole test suite on a CUDA machine (the H200 of the device tool), where the CUDA wing's tests run instead of
# skipping. That machine cannot download and takes at most 64 MiB a call, so MLX's CUDA build is staged here first:
#
#   scripts/gpu_suite.sh stage            # here: ../shared/gpu/stage.sh, plus pytest-xdist; fills .devwheels/{a,b,c}
#   device call 1, carry [".devwheels/a"]:  scripts/gpu_suite.sh copy
#   device call 2, carry [".devwheels/c"]:  scripts/gpu_suite.sh copy        # transformers for the tests, and the
#                                            tokenizer stand-in: --tokenizer-model /tmp/tokenizer-stand-in
#   device call 3, carry [".devwheels/b"]:  scripts/gpu_suite.sh run PART     # right away (the machine idles out)
#
# PART splits the suite so each call stays under the device's 10-minute limit (about 4-8 minutes each on an
# H200's 11 workers; on a machine of several GPUs, that many a GPU; fewer on a card of less memory, see below):
#   kernels  tests/mlxcel_core/backends (the CUDA kernels, the graph, the paged kernel)
#   engine   tests/mlxcel_core/{engine,server} tests/autotune
#   device   kernels and engine in one call (an H200 takes it in one; an H100's 4 workers need ~14 minutes: split it)
#   models   tests/mlxcel_core/models (the families' parity against transformers)
#   rest     everything else
#   all      the whole suite in one call
#   resume PART LOG   PART again without the tests LOG (its gpu_suite_PART.txt from a call cut off by the time
#                     limit, put in the working tree) shows finished
#   exec CMD ...  any command in the staged environment (a probe, a benchmark)
# GPU_SUITE_KEEP_CACHE=0 leaves the kernel cache on that machine (bringing it back costs ~45 s of device time a call).
# The install happens once a machine: a second `run PART` on the same warm machine reuses /tmp/site.
#
# The kernel cache (MLX's compiled kernels and ours, the driver's JIT cache) lives in /tmp/mlxcel-cache there: each
# `run` leaves it in $OUT/kcache.tgz.part0, part1, ... (15 MiB pieces, 56 MiB at most, the driver's cache left out
# where it does not fit: a call brings back files of 16 MiB at most). Bring it back here with
#   scripts/gpu_suite.sh keep /work/.device/N      # -> .devwheels/kcache/kcache.tgz
# and carry it on the next machine in a copy call: with the second (carry [".devwheels/c", ".devwheels/kcache"]) where
# both fit a call's 64 MiB beside the working tree (~4.5 MiB), else alone (carry [".devwheels/kcache"]). Kernels whose
# source is unchanged are then read, not compiled (a variant's file name carries its source's hash), and the suite
# spends less time compiling. A machine's parts share its cache, so the last part run on one machine brings back all
# of them.
# Real-model tests (marker real_model) need the SmolLM2 download, which that machine cannot make: CI runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  stage)
    python3 -c "import transformers" 2>/dev/null || { echo "gpu_suite.sh stage: install the test extras first" \
      "(README: pip install -e \".[test]\")" >&2; exit 2; }
    ../shared/gpu/stage.sh platformdirs starlette uvicorn pydantic pydantic-core annotated-types typing-inspection \
      pytest-xdist execnet mlx-lm==0.32.2 ruff import-linter grimp pexpect ptyprocess llguidance jsonschema \
      jsonschema-specifications referencing rpds-py attrs libgguf gguf pyyaml openai distro jiter sniffio tqdm \
      httpx2 httpcore2 truststore anyio idna h11
    # (the larger extra wheels ride with the second half, which has room: each call carries at most 64 MiB, the
    # working tree's ~7 MiB included; openai and llguidance ride with the third, installed beside transformers)
    mv .devwheels/a/ruff-*.whl .devwheels/a/grimp-*.whl .devwheels/b/
    mkdir -p .devwheels/c && mv .devwheels/a/openai-*.whl .devwheels/a/llguidance-*.whl .devwheels/c/
    # The test extras' transformers (that machine's is older than the GGUF tests need) rides alone in a third call,
    # with the versions of the libraries it needs that are installed here (that machine's may be too old for it;
    # transformers loads every model with `kernels` where it finds one, and refuses one outside its range).
    mkdir -p .devwheels/c
    pins=$(python3 -c 'import importlib.metadata as m
names = ("transformers", "huggingface_hub", "tokenizers", "safetensors", "kernels", "tomlkit")
print(" ".join(f"{p}=={m.version(p)}" for p in names))')
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .devwheels/c $pins
    # The default model's tokenizer beside a 1-layer model (~10 MB), for the benchmarks' --tokenizer-model there:
    # copied to /tmp/tokenizer-stand-in.
    python3 -m mlxcel_cli generate -p hi --max-tokens 1 >/dev/null  # (fetches the default model where it is missing)
    python3 benchmarks/tokenizer_stand_in.py .devwheels/c/tokenizer-stand-in
    ;;
  copy)  # once with carry [".devwheels/a"], then (if staged) once with carry [".devwheels/c"]
    mkdir -p /tmp/dw /tmp/dwc
    if [ -d .devwheels/a ]; then cp .devwheels/a/* /tmp/dw/; fi
    if [ -d .devwheels/c ]; then cp .devwheels/c/*.whl /tmp/dwc/; fi
    if [ -d .devwheels/c/tokenizer-stand-in ]; then cp -r .devwheels/c/tokenizer-stand-in /tmp/; fi
    if [ -f .devwheels/kcache/kcache.tgz ]; then
      mkdir -p /tmp/mlxcel-cache && tar xzf .devwheels/kcache/kcache.tgz -C /tmp/mlxcel-cache
      echo "kernel cache: $(find /tmp/mlxcel-cache -type f | wc -l) files"
    fi
    ;;
  keep)  # here: the kernel cache a device call left in its files folder, to carry to the next machine
    from="${2:?the files folder of the device call}"
    mkdir -p .devwheels/kcache
    if ls "$from"/kcache.tgz.part* >/dev/null 2>&1; then cat "$from"/kcache.tgz.part* > .devwheels/kcache/kcache.tgz
    else cp "$from/kcache.tgz" .devwheels/kcache/; fi
    ls -la .devwheels/kcache
    ;;
  run)
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 PATH="/tmp/site/bin:$PATH"
    export MLXCEL_CACHE_DIR="${MLXCEL_CACHE_DIR:-/tmp/mlxcel-cache}"
    keep_cache() {  # (the kernel cache back to this machine in 15 MiB pieces: a call returns files of 16 MiB at most)
      if [ -n "${OUT:-}" ] && [ "${GPU_SUITE_KEEP_CACHE:-1}" != 0 ] && [ -d "$MLXCEL_CACHE_DIR/kernels" ]; then
        du -sh "$MLXCEL_CACHE_DIR"/kernels/* 2>/dev/null | sort -h | tail -4
        local tgz=/tmp/kcache.tgz
        tar czf $tgz -C "$MLXCEL_CACHE_DIR" --exclude=".proc-*" --exclude=".tmp-*" kernels  # (not processes' own)
        if [ "$(stat -c %s $tgz)" -gt $((56 << 20)) ]; then  # without the driver's JIT cache, then
          tar czf $tgz -C "$MLXCEL_CACHE_DIR" --exclude=".proc-*" --exclude=".tmp-*" --exclude=kernels/cuda-driver \
            kernels
        fi
        if [ "$(stat -c %s $tgz)" -gt $((56 << 20)) ]; then echo "kernel cache too large to bring back"
        else split -b 15M -d -a 1 $tgz "$OUT/kcache.tgz.part" && ls -la "$OUT"/kcache.tgz.part*; fi
        rm -f $tgz
      fi
    }
    if ! python3 -c "import mlx.core" 2>/dev/null && [ ! -f /tmp/dw/cudawheel.name ]; then
      echo "gpu_suite.sh: nothing staged on this machine (a fresh one): the copy calls first" >&2; exit 3
    fi
    if ! python3 -c "import mlx.core" 2>/dev/null; then
      cp .devwheels/b/*.whl /tmp/dw/ 2>/dev/null || true
      bash .devwheels/b/install.sh >/dev/null
      if ls /tmp/dwc/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_tf /tmp/dwc/*.whl
      fi
    fi
    if [ -d /tmp/site_tf ]; then
      if tf_error=$(PYTHONPATH="/tmp/site_tf:$PYTHONPATH" python3 -c "import transformers" 2>&1); then
        export PYTHONPATH="/tmp/site_tf:$PYTHONPATH"
      else  # the machine's own transformers then: tests that need the staged one fail (GGUF vocabularies, gpt-oss)
        echo "gpu_suite.sh: the staged transformers does not import: $(echo "$tf_error" | tail -1)" >&2
      fi
    fi
    python3 -c "import mlx.core as mx, transformers; print('mlx', mx.__version__, 'transformers', transformers.__version__)"
    status=0
    if [ "${2:-}" = exec ]; then shift 2; "$@" || status=$?; keep_cache; exit $status; fi  # any command, staged
    part="${2:-all}"
    deselect=()
    if [ "$part" = resume ]; then  # (a finished test's line: "[gwN] [ NN%] PASSED tests/...::name[params]")
      part="${3:?resume PART LOG}"
      log="${4:?resume PART LOG}"
      mapfile -t done_ids < <(grep -oE "^\[gw[0-9]+\] \[ *[0-9]+%\] (PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR) tests/.*" "$log" \
        | sed -E 's/^[^]]*\] \[[^]]*\] [A-Z]+ //; s/ +$//')
      for id in "${done_ids[@]}"; do deselect+=("--deselect=$id"); done
      echo "resume $part: ${#deselect[@]} tests finished in $log"
    fi
    case "$part" in
      kernels) paths=(tests/mlxcel_core/backends) ;;
      engine) paths=(tests/mlxcel_core/engine tests/mlxcel_core/server tests/autotune) ;;
      device) paths=(tests/mlxcel_core/backends tests/mlxcel_core/engine tests/mlxcel_core/server tests/autotune) ;;
      models) paths=(tests/mlxcel_core/models) ;;
      rest) paths=(tests --ignore=tests/mlxcel_core/backends --ignore=tests/mlxcel_core/engine
                   --ignore=tests/mlxcel_core/server --ignore=tests/autotune --ignore=tests/mlxcel_core/models) ;;
      all) paths=(tests) ;;
      *) echo "unknown part: ${part}" >&2; exit 2 ;;
    esac
    # Workers a GPU: 14 (16 cores each on these machines) where the card has the memory for them, about 12 GiB a
    # worker (an H200, 141 GiB, takes 11; an H100, 80 GiB, 6), 16 GiB for the kernels, engine and device parts (8 and 4): at 7 and then 6
    # workers the device part ran an H100 out of memory (archive/2026-12-05-h100-session-29 and -30); a worker whose
    # allocation fails then fails every test after it ("illegal memory access"). Each worker runs on one GPU
    # (tests/conftest.py).
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
    export GPU_SUITE_GPUS=$(( gpus > 1 ? gpus : 1 ))
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 || true)
    per_worker=12288; case "$part" in kernels|engine|device) per_worker=16384 ;; esac
    per_gpu=$(( ${mib:-143771} / per_worker ))
    per_gpu=$(( per_gpu > 14 ? 14 : (per_gpu < 1 ? 1 : per_gpu) ))
    workers=()
    python3 -c "import xdist" 2>/dev/null && workers=(-n $(( per_gpu * GPU_SUITE_GPUS )))
    python3 -m pytest -v -p no:cacheprovider -rfE -m "not real_model" "${workers[@]}" "${paths[@]}" "${deselect[@]}" 2>&1 \
      | grep -v -e PytestBenchmarkWarning -e "warner(" | tee "${OUT:-/tmp}/gpu_suite_${2:-all}${3:+_$3}.txt" \
      | grep -v -e " PASSED " -e " SKIPPED " | tail -60 \
      || status=$?
    keep_cache
    exit $status
    ;;
  *)
    sed -n '2,15p' "$0"; exit 2
    ;;
esac

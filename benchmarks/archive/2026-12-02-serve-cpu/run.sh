#!/usr/bin/env bash
# mlxcel serve vs mlx_lm.server on the CPU VM, the same MLX 4-bit directory (SmolLM2-135M-Instruct's Q4_1 GGUF
# converted once: `mlxcel convert SmolLM2-135M-Instruct.Q4_1.gguf -o /tmp/srv/smol-q4`), one server at a time.
# Usage: bash run.sh OUTDIR CLIENTS   (from the repository root)
set -u
out=${1:?outdir}; clients=${2:?clients}; dir=/tmp/srv/smol-q4; mkdir -p "$out"
ready() { for _ in $(seq 240); do curl -sf "http://127.0.0.1:$1$2" >/dev/null 2>&1 && return 0; sleep 0.5; done; return 1; }
stop() { kill -TERM "$1"; for _ in $(seq 20); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.5; done; kill -KILL "$1"; }
python -m mlxcel_cli.main serve -m "$dir" --port 8090 --max-batch-size 16 > "$out/mlxcel_server_$clients.log" 2>&1 &
pid=$!; ready 8090 /health || echo "mlxcel server not ready"   # (/health turns 200 after the load and warm-up)
python benchmarks/serve_load.py --url http://127.0.0.1:8090 --clients "$clients" --duration 30 --max-tokens 32 \
  > "$out/mlxcel_c$clients.txt" 2>&1
stop $pid
python -m mlx_lm server --model "$dir" --port 8091 > "$out/mlx_lm_server_$clients.log" 2>&1 &
pid=$!; ready 8091 /v1/models || echo "mlx_lm server not ready"
python benchmarks/serve_load.py --url http://127.0.0.1:8091 --clients "$clients" --duration 30 --max-tokens 32 \
  --model "$dir" > "$out/mlx_lm_c$clients.txt" 2>&1
stop $pid

set -x
cd /work/main
for dt in bfloat16 float16 float32; do for mode in off on; do
  if [ $mode = off ]; then cmd="python benchmarks/archive/2026-12-02-cpu-float32/off.py"; else cmd="python -m mlxcel_cli.main"; fi
  echo "== $dt $mode"; $cmd bench --model-shape smollm2-135m --bits 4 --dtype $dt -p 0 -n 16 -r 2 -o md 2>&1 | grep -E "tg16|^mlxcel "
done; done
# a real checkpoint as people download it: SmolLM2-135M-Instruct as an MLX 4-bit directory with bfloat16 scales
rm -rf /tmp/cpu-f32/smol-q4-bf16
python -m mlxcel_cli.main convert "$(python -c 'from mlxcel_core.loading.resolve import fetch_default_gguf; print(fetch_default_gguf(log=lambda m: None))')" -o /tmp/cpu-f32/smol-q4-bf16 --dtype bfloat16 2>&1 | tail -2
python benchmarks/compare_mlx_lm.py --model /tmp/cpu-f32/smol-q4-bf16 --prompt-tokens 16 --gen-tokens 16 --rounds 2 2>&1 | tail -8

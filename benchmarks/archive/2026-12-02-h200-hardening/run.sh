#!/usr/bin/env bash
# Issue 43's H200 figures: the prefill chunk beside a running row (item 7), the hostile load test (acceptance, item 14's setup).
set -x
O=${OUT:-/tmp}
timeout 150 python3 benchmarks/prefill_chunk.py --model-shape llama-3-8b --bits 4 --chunks 2048,1024,512 \
  --prompt-tokens 4096 --decode-steps 8 > $O/prefill_chunk_8b.txt 2>&1; echo rc=$? >> $O/prefill_chunk_8b.txt
tail -12 $O/prefill_chunk_8b.txt
timeout 240 python3 benchmarks/serve_hostile.py --model-shape llama-3.2-1b --bits 4 --dtype float32 --clients 64 \
  --stalled 200 --max-tokens 48 --batch 32 > $O/hostile_1b.txt 2>&1; echo rc=$? >> $O/hostile_1b.txt
tail -25 $O/hostile_1b.txt

#!/usr/bin/env bash
# A/B: HEAD (before: packed 4-row products on AVX2) against the working tree (on AVX-512), alternating, two rounds.
set -u
out=${1:?out file}
for round in 1 2; do
  if [ $round = 1 ]; then order="before after"; else order="after before"; fi
  for which in $order; do
    tree=/work/main; [ $which = before ] && tree=/work/scratch/before_b4
    echo "== round $round $which ($tree)" | tee -a "$out"
    (cd $tree && PYTHONPATH=$tree python -m mlxcel_cli.main bench -p 0 -n 32 -b 4 -r 3 2>&1 | grep -E "tg[0-9]") | tee -a "$out"
  done
done

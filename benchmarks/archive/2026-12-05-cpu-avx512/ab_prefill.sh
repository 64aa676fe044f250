#!/usr/bin/env bash
# A/B: HEAD (before: blas_rows.c AVX2 only) against the working tree (AVX-512 blocks of 4 rows), alternating.
set -u
out=${1:?out file}
for round in 1 2; do
  if [ $round = 1 ]; then order="before after"; else order="after before"; fi
  for which in $order; do
    tree=/work/main; [ $which = before ] && tree=/work/scratch/before_rows
    echo "== round $round $which ($tree)" | tee -a "$out"
    (cd $tree && PYTHONPATH=$tree python -m mlxcel_cli.main bench -p 64,256 -n 0 -r 3 2>&1 | grep -E "pp[0-9]") | tee -a "$out"
  done
done

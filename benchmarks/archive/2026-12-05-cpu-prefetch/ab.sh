#!/usr/bin/env bash
# A/B: the tree before (a `git archive` copy at BEFORE) against /work/main, alternating, two rounds, one
# `mlxcel bench` each: bash ab.sh BEFORE OUT BENCH_ARGS...
#   ab_prefill.txt: BEFORE at 1e960e9, BENCH_ARGS -p 64,256 -n 0 -r 3
#   ab_batch4.txt:  BEFORE at 1b3c3f6, BENCH_ARGS -p 0 -n 32 -b 4 -r 3
#   ab_batch8.txt:  BEFORE at 7e60291, BENCH_ARGS -p 0 -n 32 -b 8 -r 3
set -u
before=${1:?before tree}; out=${2:?out file}; shift 2
for round in 1 2; do
  if [ $round = 1 ]; then order="before after"; else order="after before"; fi
  for which in $order; do
    tree=/work/main; [ $which = before ] && tree=$before
    echo "== round $round $which ($tree)" | tee -a "$out"
    (cd $tree && PYTHONPATH=$tree python -m mlxcel_cli.main bench "$@" 2>&1 | grep -E "(pp|tg)[0-9]") | tee -a "$out"
  done
done

#!/usr/bin/env bash
# A/B of the pack's early kSent read (A: this tree) against the wait before the index (B: wip/ab/pack-wait-first.patch),
# rebuilt between runs, decode across two "nodes" on one GPU (staged shm), in the order A B A B.
ROOT=$(pwd)
base=${OUT:-gpu_out}
i=0
for v in ${AB_ORDER:-A B A B}; do
  i=$((i + 1))
  [ "$v" = B ] && patch -s -p1 < wip/ab/pack-wait-first.patch
  OUT=$base/$i$v NODES_PROVIDERS=${NODES_PROVIDERS:-shm} NODES_MEMORY=staged NODES_SHAPE=${NODES_SHAPE:-decode} \
    NODES_ITERS=${NODES_ITERS:-100} bash tests/gpu/device_run.sh build,nodes 2>&1 | grep -E "SUMMARY|trace gpu0|dispatch|combine" | head -30
  [ "$v" = B ] && patch -s -R -p1 < wip/ab/pack-wait-first.patch
done
cat "$base"/*/summary.txt

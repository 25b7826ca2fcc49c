#!/usr/bin/env bash
# A/B of the send halves' poll blocks (A: this tree, where they landed in cad574e) against the kernels before them
# (B: wip/ab/combine-poll.patch reversed, then wip/ab/pack-wait-first.patch: the kernels of c116633 with the pack
# phases traced), rebuilt between runs, decode across two "nodes" on one GPU (staged shm), in the order $AB_ORDER.
# docs/benchmarks.md, "2026-12-06, night" and "2026-12-07", has what it measured.
ROOT=$(pwd)
base=${OUT:-gpu_out}
# $AB_VERIFY: first the one-call verification of this tree (GPU suite, demo)
[ -n "$AB_VERIFY" ] && OUT=$base/0verify bash tests/gpu/device_run.sh build,gpu,demo 2>&1 |
  grep --line-buffered -E "SUMMARY|FAILED|Error|(passed|failed) in"  # no tail: a call cut short keeps what it printed
i=0
for v in ${AB_ORDER:-A B A B}; do
  i=$((i + 1))
  [ "$v" = B ] && patch -s -R -p1 < wip/ab/combine-poll.patch
  [ "$v" = B ] && patch -s -p1 < wip/ab/pack-wait-first.patch
  # the floors (EP1 run, the engine's one-way) once, from the first run: neither depends on the variants
  [ $i -gt 1 ] && [ -z "$AB_FLOORS_EACH" ] && mkdir -p "$base/$i$v" && cp -r "$base/1"*/floor_cache "$base/$i$v/" 2>/dev/null
  OUT=$base/$i$v NODES_PROVIDERS=${NODES_PROVIDERS:-shm} NODES_MEMORY=staged NODES_SHAPE=${NODES_SHAPE:-decode} \
    NODES_ITERS=${NODES_ITERS:-100} bash tests/gpu/device_run.sh build,nodes 2>&1 | grep --line-buffered -E "SUMMARY|^(decode|prefill) .*(dispatch_send|combine_send|dispatch |combine ) "
  grep -hE "trace gpu0|stamp gaps gpu0" "$base/$i$v"/nodes_*.log | sort -u  # the stage prints only its log's tail
  [ "$v" = B ] && patch -s -R -p1 < wip/ab/pack-wait-first.patch
  [ "$v" = B ] && patch -s -p1 < wip/ab/combine-poll.patch
done
# $AB_PROFILE: one more run of A under jax.profiler (the floors from the first run's cache): each kernel's duration
# and the gap before it on its stream, beside the stamp-to-stamp p50s
[ -n "$AB_PROFILE" ] && mkdir -p "$base/prof" && cp -r "$base/1"*/floor_cache "$base/prof/" 2>/dev/null
[ -n "$AB_PROFILE" ] && OUT=$base/prof JAX_MOE_BENCH_PROFILE=/tmp/jax_moe_prof NODES_PROVIDERS=${NODES_PROVIDERS:-shm} \
  NODES_MEMORY=staged NODES_SHAPE=${NODES_SHAPE:-decode} NODES_ITERS=${NODES_ITERS:-100} \
  bash tests/gpu/device_run.sh nodes 2>&1 | grep -E -A18 "GPU activity|^(decode|prefill) .*(dispatch_send|combine_send) "
cat "$base"/*/summary.txt

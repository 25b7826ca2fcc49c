#!/usr/bin/env bash
# A/B of the pack blocks beside a poll block (A: this tree) against pack block 0 polling before the index (B:
# wip/ab/pack-wait-first.patch: the kernels of c116633 with the pack phases traced),
# rebuilt between runs, decode across two "nodes" on one GPU (staged shm), in the order A B A B.
ROOT=$(pwd)
base=${OUT:-gpu_out}
# $AB_APPLY: A is main with wip/pack-poll.patch applied (it has not landed: no GPU run verified it)
[ -n "$AB_APPLY" ] && patch -s -p1 < wip/pack-poll.patch
# $AB_COMBINE: A also has wip/combine-poll.patch (combine_send's block 0 polls the lane for the other blocks), B not
# $AB_LANDED: both patches are committed already (A is the tree as it is; B still reverses combine-poll)
[ -n "$AB_COMBINE" ] && [ -z "$AB_LANDED" ] && patch -s -p1 < wip/combine-poll.patch
# $AB_VERIFY: first the one-call verification of this tree (GPU suite, demo)
[ -n "$AB_VERIFY" ] && OUT=$base/0verify bash tests/gpu/device_run.sh build,gpu,demo 2>&1 |
  grep --line-buffered -E "SUMMARY|FAILED|Error|(passed|failed) in"  # no tail: a call cut short keeps what it printed
i=0
for v in ${AB_ORDER:-A B A B}; do
  i=$((i + 1))
  [ "$v" = B ] && [ -n "$AB_COMBINE" ] && patch -s -R -p1 < wip/combine-poll.patch
  [ "$v" = B ] && patch -s -p1 < wip/ab/pack-wait-first.patch
  # the floors (EP1 run, the engine's one-way) once, from the first run: neither depends on the variants
  [ $i -gt 1 ] && [ -z "$AB_FLOORS_EACH" ] && mkdir -p "$base/$i$v" && cp -r "$base/1"*/floor_cache "$base/$i$v/" 2>/dev/null
  OUT=$base/$i$v NODES_PROVIDERS=${NODES_PROVIDERS:-shm} NODES_MEMORY=staged NODES_SHAPE=${NODES_SHAPE:-decode} \
    NODES_ITERS=${NODES_ITERS:-100} bash tests/gpu/device_run.sh build,nodes 2>&1 | grep --line-buffered -E "SUMMARY|^(decode|prefill) .*(dispatch_send|combine_send|dispatch |combine ) "
  grep -hE "trace gpu0|stamp gaps gpu0" "$base/$i$v"/nodes_*.log | sort -u  # the stage prints only its log's tail
  [ "$v" = B ] && patch -s -R -p1 < wip/ab/pack-wait-first.patch
  [ "$v" = B ] && [ -n "$AB_COMBINE" ] && patch -s -p1 < wip/combine-poll.patch
done
# $AB_PROFILE: one more run of A under jax.profiler (the floors from the first run's cache): each kernel's duration
# and the gap before it on its stream, beside the stamp-to-stamp p50s
[ -n "$AB_PROFILE" ] && mkdir -p "$base/prof" && cp -r "$base/1"*/floor_cache "$base/prof/" 2>/dev/null
[ -n "$AB_PROFILE" ] && OUT=$base/prof JAX_MOE_BENCH_PROFILE=/tmp/jax_moe_prof NODES_PROVIDERS=${NODES_PROVIDERS:-shm} \
  NODES_MEMORY=staged NODES_SHAPE=${NODES_SHAPE:-decode} NODES_ITERS=${NODES_ITERS:-100} \
  bash tests/gpu/device_run.sh nodes 2>&1 | grep -E -A18 "GPU activity|^(decode|prefill) .*(dispatch_send|combine_send) "
cat "$base"/*/summary.txt

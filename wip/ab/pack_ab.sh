#!/usr/bin/env bash
# A/B of kernel changes across two "nodes" on one GPU (staged shm): A is this tree, B the same with the patches of
# $AB_B_REVERSE reversed, then those of $AB_B_APPLY applied (default: B = wip/ab/derive-index.patch reversed, the
# prefill index launch of cad574e), rebuilt between runs, in the order $AB_ORDER, at $NODES_SHAPE (decode). More
# variants: any other capital letter X in $AB_ORDER is this tree with $AB_X_REVERSE reversed and $AB_X_APPLY applied
# (e.g. AB_ORDER="A B C" AB_C_REVERSE=wip/ab/x.patch), all with the first run's floors.
# The A/B of 2026-12-07 (the send halves' poll blocks, as of cad574e): AB_B_REVERSE=wip/ab/combine-poll.patch
# AB_B_APPLY=wip/ab/pack-wait-first.patch. docs/benchmarks.md, "2026-12-06, night" and "2026-12-07", has what they
# measured.
ROOT=$(pwd)
base=${OUT:-gpu_out}
B_REVERSE=${AB_B_REVERSE-wip/ab/derive-index.patch}
B_APPLY=${AB_B_APPLY-}
# $AB_VERIFY: first the one-call verification of this tree (GPU suite, demo)
[ -n "$AB_VERIFY" ] && OUT=$base/0verify bash tests/gpu/device_run.sh build,gpu,demo 2>&1 |
  grep --line-buffered -E "SUMMARY|FAILED|Error|(passed|failed) in"  # no tail: a call cut short keeps what it printed
i=0
for v in ${AB_ORDER:-A B A B}; do
  i=$((i + 1))
  if [ "$v" = B ]; then rev=$B_REVERSE app=$B_APPLY; else rev_name=AB_${v}_REVERSE app_name=AB_${v}_APPLY; rev=${!rev_name-} app=${!app_name-}; fi
  [ "$v" != A ] && [ "$v" != B ] && [ -z "$rev$app" ] && { echo "pack_ab: variant $v has no AB_${v}_REVERSE or AB_${v}_APPLY" >&2; exit 1; }
  if [ "$v" != A ]; then
    for pt in $rev; do patch -s --no-backup-if-mismatch -R -p1 < "$pt" || exit 1; done
    for pt in $app; do patch -s --no-backup-if-mismatch -p1 < "$pt" || exit 1; done
  fi
  # the floors (EP1 run, the engine's one-way) once, from the first run: neither depends on the variants
  [ $i -gt 1 ] && [ -z "$AB_FLOORS_EACH" ] && mkdir -p "$base/$i$v" && cp -r "$base/1"*/floor_cache "$base/$i$v/" 2>/dev/null
  OUT=$base/$i$v NODES_PROVIDERS=${NODES_PROVIDERS:-shm} NODES_MEMORY=staged NODES_SHAPE=${NODES_SHAPE:-decode} \
    NODES_ITERS=${NODES_ITERS:-100} bash tests/gpu/device_run.sh build,nodes 2>&1 | grep --line-buffered -E "SUMMARY|^(decode|prefill) .*(dispatch_send|combine_send|dispatch |combine ) "
  grep -hE "trace gpu0|stamp gaps gpu0" "$base/$i$v"/nodes_*.log | sort -u  # the stage prints only its log's tail
  if [ "$v" != A ]; then  # back to A, in the reverse order
    for pt in $(printf '%s\n' $app | tac); do patch -s --no-backup-if-mismatch -R -p1 < "$pt" || exit 1; done
    for pt in $(printf '%s\n' $rev | tac); do patch -s --no-backup-if-mismatch -p1 < "$pt" || exit 1; done
  fi
done
# $AB_PROFILE: one more run of A under jax.profiler (the floors from the first run's cache): each kernel's duration
# and the gap before it on its stream, beside the stamp-to-stamp p50s
[ -n "$AB_PROFILE" ] && mkdir -p "$base/prof" && cp -r "$base/1"*/floor_cache "$base/prof/" 2>/dev/null
[ -n "$AB_PROFILE" ] && OUT=$base/prof JAX_MOE_BENCH_PROFILE=/tmp/jax_moe_prof NODES_PROVIDERS=${NODES_PROVIDERS:-shm} \
  NODES_MEMORY=staged NODES_SHAPE=${NODES_SHAPE:-decode} NODES_ITERS=${NODES_ITERS:-100} \
  bash tests/gpu/device_run.sh nodes 2>&1 | grep -E -A18 "GPU activity|^(decode|prefill) .*(dispatch_send|combine_send) "
cat "$base"/*/summary.txt

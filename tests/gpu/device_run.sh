#!/usr/bin/env bash
# One call verifies a commit on the lent GPU machine (docs/cuda.md, "Verification"):
#   bash tests/gpu/device_run.sh [STAGES] [bench args...]
# STAGES: comma-separated from build, cpu, gpu, demo, bench, ep1, proxy, overlap, nodes, ab, xoverlap, mb, stagediag,
# ipc, hmem (default: build,cpu,gpu,demo). hmem comes last: it rebuilds against libfabric 2.6 with CUDA (see below). The
# full build uses the libfabric headers carried in third_party_headers/libfabric (the image has the runtime only). Logs
# go to $OUT (or ./gpu_out); the last lines printed are "SUMMARY ..." lines, one per stage. NVLink multicast stays off.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export JAX_MOE_TIMEOUT_S=${JAX_MOE_TIMEOUT_S:-20}  # a protocol bug shows up as an error, not a long hang
STAGES=${1:-build,cpu,gpu,demo}
shift || true
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
summary=()
has() { [[ ",$STAGES," == *",$1,"* ]]; }
stage() {  # stage NAME LIMIT_S CMD...: runs CMD with a time bound, logs to $OUT/NAME.log, records a summary line
  local name=$1 limit=$2 t0=$(date +%s) rc
  shift 2
  echo "=== $name"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -25 "$OUT/$name.log"
  local tally
  tally=$(grep -E "[0-9]+ (passed|failed)" "$OUT/$name.log" | tail -1)  # pytest's tally, if the stage ran tests
  summary+=("SUMMARY $name: rc=$rc ($(( $(date +%s) - t0 )) s) ${tally}")
  echo "${summary[-1]}" >> "$OUT/summary.txt"  # kept even if a later stage runs past the call's limit
}

rm -f "$OUT/summary.txt"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
python3 -c 'import jax, flax, sys; print("python", sys.version.split()[0], "jax", jax.__version__, "flax", flax.__version__)'

LF=$ROOT/third_party_headers/libfabric
if [ -d "$LF/include/rdma" ] && [ -e /usr/lib/x86_64-linux-gnu/libfabric.so.1 ]; then
  mkdir -p "$LF/lib" "$LF/pkgconfig"
  ln -sf /usr/lib/x86_64-linux-gnu/libfabric.so.1 "$LF/lib/libfabric.so"
  printf 'prefix=%s\nlibdir=${prefix}/lib\nincludedir=${prefix}/include\n\nName: libfabric\nDescription: libfabric (headers carried)\nVersion: 1.17.0\nLibs: -L${libdir} -lfabric\nCflags: -I${includedir}\n' \
    "$LF" > "$LF/pkgconfig/libfabric.pc"
  export PKG_CONFIG_PATH=$LF/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH} LIBRARY_PATH=$LF/lib
fi

if has build; then
  stage build 400 bash -c 'python3 -m pip install --no-build-isolation --no-deps -e . && \
    python3 -c "import jax_moe._core as c; print(\"jax_moe._core:\", c.build_info())"'
fi
if has cpu; then  # the CPU suite on the newest jax, one file per worker (its multiprocess tests stay serial)
  stage cpu 420 env JAX_PLATFORMS=cpu python3 -m pytest -q -p no:cacheprovider -n 6 --dist loadfile -m "not gpu" tests
fi
if has gpu; then
  # $GPU_TESTS: the test files and options (default: every GPU test); the slow fuzz's cases are cut to 12 (each
  # compiles its own programs: 40 would not fit one verification call)
  # --durations: what the 285 s go to (a shorter verification fits more sessions' device time)
  stage gpu 420 env JAX_MOE_FUZZ_MANY=${JAX_MOE_FUZZ_MANY:-12} python3 -m pytest -q -p no:cacheprovider --capture=sys --runslow --durations=25 -m gpu ${GPU_TESTS:-tests}  # C++ aborts reach the log
fi
if has demo; then  # the README's demo on the GPUs: backend "auto" picks "cuda"
  stage demo 300 bash -c 'python3 examples/train_moe.py --steps 60 --log-every 20 --out runs/gpu_demo && \
    python3 examples/decode_moe.py --checkpoint runs/gpu_demo --max_new_tokens 60'
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then  # the examples with one process per GPU
    stage demo_mp 300 bash -c 'python3 examples/launch.py -n 2 --gpu-per-process --timeout 140 -- \
      examples/train_moe.py --steps 30 --log-every 10 --out runs/gpu_mp && \
      python3 examples/launch.py -n 2 --gpu-per-process --timeout 100 -- \
      examples/decode_moe.py --checkpoint runs/gpu_mp --max_new_tokens 40'
  fi
fi
if has bench; then
  stage bench ${BENCH_LIMIT_S:-400} python3 -m jax_moe.bench moe --out "$OUT/bench" "$@"
fi
if has ep1; then  # the one-shot calls as one kernel (default) against two kernels, with the device trace, and the
  # command-buffer handlers, on this machine's GPUs
  stage ep1 ${EP1_LIMIT_S:-240} env JAX_MOE_CUDA_TRACE=1 python3 -m jax_moe.bench moe --backend cuda,xla \
    --shape "${EP1_SHAPE:-decode,prefill}" --iters "${EP1_ITERS:-400}" --out "$OUT/ep1"
  stage ep1_two_kernels ${EP1_LIMIT_S:-240} env JAX_MOE_CUDA_TRACE=1 JAX_MOE_CUDA_ONE_KERNEL=0 python3 -m jax_moe.bench \
    moe --backend cuda --shape "${EP1_SHAPE:-decode,prefill}" --iters "${EP1_ITERS:-400}" --out "$OUT/ep1_two"
  stage ep1_graphs ${EP1_LIMIT_S:-240} env JAX_MOE_CUDA_COMMAND_BUFFERS=1 python3 -m jax_moe.bench moe --backend cuda \
    --shape "${EP1_SHAPE:-decode,prefill}" --iters "${EP1_ITERS:-400}" --out "$OUT/ep1_graphs"  # command buffers
fi
if has proxy; then  # the host path alone (issue 13): proxy round trip and raw engine, fi_pingpong beside them
  [ -x "$LF/bin/fi_pingpong" ] && export PATH=$LF/bin:$PATH  # carried: the image has no libfabric-bin
  stage proxy_pump 200 python3 -m jax_moe.bench pump --providers shm,tcp --json "$OUT/pump.json"
  stage proxy_fabric 200 python3 -m jax_moe.bench fabric --providers shm,tcp --peers 1 --sizes 64,512K,4M \
    --json "$OUT/fabric.json"
fi
if has overlap; then  # issue 14's overlap benchmark: on the GPU (one GPU: EP1, the code path) and on the host's CPUs
  stage overlap_gpu 200 python3 -m jax_moe.bench overlap --json "$OUT/overlap_gpu.json"
  stage overlap_cpu 200 env JAX_PLATFORMS=cpu python3 -m jax_moe.bench overlap --backend cpu,xla \
    --json "$OUT/overlap_cpu.json"
fi
mps_start() {  # two processes on one GPU run their kernels side by side only under MPS
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/jax_moe_mps CUDA_MPS_LOG_DIRECTORY=/tmp/jax_moe_mps_log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d
}
loading() {  # MEMORY: the CUDA_MODULE_LOADING=... its workers need: "staged", and "device" on shm and tcp, need
  # eager loading (docs/cuda.md); the others run under $CUDA_MODULE_LOADING (default lazy, CUDA's own)
  case $1 in staged|device) echo CUDA_MODULE_LOADING=EAGER ;; *) echo "CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-LAZY}" ;; esac
}
mps_stop() { echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
nodes_bench() {  # TAG: the cross-node decode benchmark on one GPU, two processes under MPS with half the SMs each,
  # for each provider and area memory ($NODES_MEMORY: "host", "staged", "device", "auto"); the floors' EP1 run and
  # each provider's one-way are measured once in the call (--floor-cache)
  local tag=$1 provider memory
  mps_start
  for provider in ${NODES_PROVIDERS:-shm tcp}; do
    for memory in ${NODES_MEMORY:-auto}; do
      local eager
      eager=$(loading "$memory")
      stage "${tag}_${provider}_${memory}" ${NODES_LIMIT_S:-400} env $eager CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 \
        JAX_MOE_CUDA_TRACE=1 JAX_MOE_FABRIC_MEMORY=$memory python3 -m jax_moe.bench moe --backend cuda --shape "${NODES_SHAPE:-decode}" \
        --iters "${NODES_ITERS:-200}" --processes 2 --ranks-per-node 1 --provider "$provider" \
        --floor-cache "$OUT/floor_cache" --out "$OUT/${tag}_${provider}_${memory}"
    done
  done
  mps_stop
}
if has nodes; then  # ranks on other nodes (issue 13) with the image's libfabric 1.17 (no CUDA: host memory)
  nodes_bench nodes
fi
if has ab; then  # an A/B of settings across nodes in one sitting (bench ab: $AB_VARIANTS, space-separated
  # NAME:KEY=VALUE[,...], the first the baseline; $AB_ROUNDS rounds in alternating order), two processes under MPS as
  # two nodes on the first of $NODES_PROVIDERS, areas in $NODES_MEMORY (one), shapes $NODES_SHAPE
  mps_start
  ab_memory=${NODES_MEMORY:-auto}
  ab_memory=${ab_memory%% *}
  ab_eager=$(loading "$ab_memory")
  read -ra ab_list <<< "${AB_VARIANTS:-}"  # split on blanks, no globbing; none: bench ab says what it needs
  ab_variants=()
  for v in "${ab_list[@]}"; do ab_variants+=(--variant "$v"); done
  ab_providers=${NODES_PROVIDERS:-shm}
  # $AB_RUN_S bounds each run of bench moe; $AB_LIMIT_S the stage (a cut-short stage keeps ab.json's finished rounds)
  stage ab ${AB_LIMIT_S:-560} env "$ab_eager" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 JAX_MOE_CUDA_TRACE=1 \
    "JAX_MOE_FABRIC_MEMORY=$ab_memory" python3 -m jax_moe.bench ab "${ab_variants[@]}" --rounds "${AB_ROUNDS:-3}" \
    --timeout "${AB_RUN_S:-150}" --out "$OUT/ab" -- --backend cuda --shape "${NODES_SHAPE:-decode}" \
    --iters "${NODES_ITERS:-100}" --processes 2 --ranks-per-node 1 --provider "${ab_providers%% *}"
  mps_stop
fi
if has xoverlap; then  # overlap across nodes (issue 25): two processes under MPS as two nodes, per area memory,
  # $XOVERLAP_REPEAT runs each (the shared machine's rows vary between runs), on the first of $NODES_PROVIDERS
  mps_start
  providers=${NODES_PROVIDERS:-shm tcp}
  for memory in ${NODES_MEMORY:-auto}; do
    eager=$(loading "$memory")
    for run in $(seq "${XOVERLAP_REPEAT:-1}"); do
      tag="xoverlap_${memory}"
      [ "${XOVERLAP_REPEAT:-1}" = 1 ] || tag="${tag}_${run}"
      stage "$tag" 300 env $eager CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 JAX_MOE_FABRIC_MEMORY=$memory \
        python3 -m jax_moe.bench overlap --processes 2 --ranks-per-node 1 --provider "${providers%% *}" \
        --iters 50 --json "$OUT/${tag}.json"
    done
  done
  mps_stop
fi
if has mb; then  # two micro-batches in one layer (issue 26, rounds_in_flight = 2): EP1, then two processes under MPS
  # as one node (CUDA IPC) and as two nodes (the host proxy, $MB_PROVIDER, areas in $MB_MEMORY: auto, host, staged)
  stage mb_ep1 200 python3 -m jax_moe.bench overlap --micro-batches --iters 100 --json "$OUT/mb_ep1.json"
  mps_start
  stage mb_ipc 240 env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 python3 -m jax_moe.bench overlap --micro-batches \
    --iters 50 --processes 2 --ranks-per-node 2 --json "$OUT/mb_ipc.json"
  mb_eager=$(loading "${MB_MEMORY:-auto}")
  stage mb_nodes 240 env $mb_eager CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 JAX_MOE_FABRIC_MEMORY=${MB_MEMORY:-auto} \
    python3 -m jax_moe.bench overlap --micro-batches \
    --iters 50 --processes 2 --ranks-per-node 1 --provider "${MB_PROVIDER:-shm}" --json "$OUT/mb_nodes.json"
  mps_stop
fi
if has stagediag; then  # fabric_memory="staged" under MPS (docs/cuda.md, "Open: staged under MPS"): the decode
  # benchmark with the proxy's hooks inspected and a long timeout (eager loading slows start-up, and two processes that start
  # far apart look like a dead peer): host areas under eager loading (does eager loading alone break it?), then staged
  # with 8 (the default) and 32 hardware queues per process
  mps_start
  for variant in host:8 staged:8 staged:32; do
    stage "stagediag_${variant/:/_}" 150 env CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=${variant#*:} \
      JAX_MOE_FABRIC_INSPECT=1 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 JAX_MOE_FABRIC_MEMORY=${variant%:*} \
      JAX_MOE_TIMEOUT_S=60 python3 -m jax_moe.bench moe --backend cuda --shape decode --iters 20 --processes 2 \
      --ranks-per-node 1 --provider shm --floor-timeout 0 --out "$OUT/stagediag_${variant/:/_}"
  done
  mps_stop
fi
if has ipc; then  # EP2 through the NVLink kernels between two processes (CUDA IPC); with one GPU both share it under
  # MPS (half the SMs each, HBM instead of NVLink): the summed combine (cuda) against rows per (t, k) (cuda-entry),
  # then the one-shot calls as two kernels
  [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || mps_start
  stage ipc ${IPC_LIMIT_S:-300} env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 JAX_MOE_CUDA_TRACE=1 \
    python3 -m jax_moe.bench moe --backend cuda,cuda-entry --shape "${IPC_SHAPE:-decode,prefill}" \
    --iters "${IPC_ITERS:-200}" --processes 2 --ranks-per-node 2 --out "$OUT/ipc"
  stage ipc_two_kernels ${IPC_LIMIT_S:-300} env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 JAX_MOE_CUDA_TRACE=1 \
    JAX_MOE_CUDA_ONE_KERNEL=0 python3 -m jax_moe.bench moe --backend cuda --shape "${IPC_SHAPE:-decode,prefill}" \
    --iters "${IPC_ITERS:-200}" --processes 2 --ranks-per-node 2 --out "$OUT/ipc_two"
  [ -z "${CUDA_MPS_PIPE_DIRECTORY:-}" ] || mps_stop
fi
if has hmem; then  # issue 25: libfabric 2.6 built with CUDA (carried in third_party_headers/vendor), the project
  # rebuilt against it, then the cross-node GPU tests and benchmarks with the areas in GPU memory and in host memory
  LFI=/tmp/lfi
  if [ -e "$ROOT/third_party_headers/lfi/lib/libfabric.so" ]; then  # built ahead with CUDA and carried (DEVELOPERS.md)
    LFI=$ROOT/third_party_headers/lfi
  else
    stage hmem_libfabric 300 bash -c 'rm -rf /tmp/lfi && bash tests/gpu/libfabric_cuda.sh /tmp/lfi'
  fi
  FI_LOG_LEVEL=info "$LFI/bin/fi_info" -p shm -c FI_HMEM 2>&1 | grep -i -m3 "hmem\|cuda"
  export LIBFABRIC_ROOT=$LFI LD_LIBRARY_PATH=$LFI/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  stage hmem_build 400 bash -c 'python3 -m pip install --no-build-isolation --no-deps -e . \
    --config-settings=build-dir=build/lf26 && python3 -c "import jax_moe._core as c; print(\"jax_moe._core:\", c.build_info())"'
  # $HMEM_TESTS: the test files and options (default: the cross-node tests and the engine on GPU memory);
  # HMEM_FABRIC=0 / HMEM_BENCH=0 skip the CPU fabric tests / the benchmarks
  stage hmem_tests 600 python3 -m pytest -q -p no:cacheprovider --capture=sys --runslow -m gpu \
    ${HMEM_TESTS:-tests/gpu/test_cuda_nodes.py tests/gpu/test_fabric_gpu_memory.py}
  [ "${HMEM_FABRIC:-1}" = 0 ] || stage hmem_fabric 300 env JAX_PLATFORMS=cpu python3 -m pytest -q -p no:cacheprovider \
    -n 4 tests/fabric
  [ "${HMEM_BENCH:-1}" = 0 ] || NODES_MEMORY=${HMEM_MEMORY:-device host} nodes_bench hmem
fi
printf '%s\n' "${summary[@]}"

#!/usr/bin/env bash
# Build, GPU tests and benchmark in one call on the lent GPU machine (see docs/cuda.md):
#   bash tests/gpu/device_run.sh [pytest -k expression] [bench args...]
# Writes logs under $OUT (or ./gpu_out). NVLink multicast stays off (the machine's rule).
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export JAX_MOE_CUDA_TIMEOUT_S=${JAX_MOE_CUDA_TIMEOUT_S:-20}  # a protocol bug shows up as an error, not a long hang
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
KEXPR=${1:-}
shift || true
OUT=$(cd "$OUT" && pwd)
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
start=$(date +%s)
# Build from a copy holding only what the cuda backend needs (common, kernels, ffi/cuda, the cuda binding): other
# layers' work in progress need not compile on this image, and the pkg-config providers are skipped.
rm -rf /tmp/jm && mkdir -p /tmp/jm && cp -a . /tmp/jm && cd /tmp/jm && rm -rf build
rm -rf src/fabric src/proxy src/cpu src/ffi/*.cc src/python/fabric_*.cc src/python/cpu_*.cc
python3 -m pip install --no-build-isolation --no-deps -e . -Ccmake.define.CMAKE_DISABLE_FIND_PACKAGE_PkgConfig=TRUE \
  > "$OUT/build.log" 2>&1 || { tail -80 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
if [ "$KEXPR" != "skip" ]; then
  timeout ${TEST_TIMEOUT:-480} python3 -m pytest -q -m gpu tests --ignore=tests/fabric -p no:cacheprovider ${KEXPR:+-k "$KEXPR"} 2>&1 | tee "$OUT/tests.log" | tail -40
fi
if [ "$#" -gt 0 ]; then
  python3 -m jax_moe.bench moe --out "$OUT/bench" "$@" 2>&1 | tee "$OUT/bench.log" | tail -40
fi
echo "total: $(( $(date +%s) - start )) s"

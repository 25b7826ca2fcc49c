#!/usr/bin/env bash
# DeepEP (deepseek-ai/DeepEP, V1 API) as a benchmark peer for jax_moe.
# Run ON the GPU machine, from the repo root:   bash wip/peers/deepep.sh
# See wip/peers/README.md for how to make the tarball it needs
# (wip/peers/DeepEP.tar.gz, from DeepEP commit 567632d; not committed).
#
# Steps: (1) probe torch / nvcc / GPUs, (2) unpack + build DeepEP intranode-only
# (no NVSHMEM) into a temp dir, (3) run DeepEP's own tests/test_intranode.py at a
# decode shape. Every step is logged to ${OUT:-gpu_out}/deepep/ and wrapped in
# `timeout`. Exit 0 when a prerequisite is missing (no torch, no tarball,
# fewer than 2 GPUs); exit 1 when a build or test that should run fails.
#
# Knobs (env): DEEPEP_PYTHON (skip the search), DEEPEP_TARBALL, DEEPEP_WORK
# (build dir, reused if the tarball is unchanged), DEEPEP_BUILD_TIMEOUT (s),
# DEEPEP_TEST_TIMEOUT (s), DEEPEP_NUM_TOKENS (default 128), DEEPEP_PREFILL=1
# (also run DeepEP's default 4096-token shape), DEEPEP_FORCE_REBUILD=1.
set -u

OUTD="${OUT:-gpu_out}/deepep"
mkdir -p "$OUTD"
exec > >(tee -a "$OUTD/deepep.log") 2>&1
TEE_PID=$!; trap 'exec >&- 2>&-; wait "$TEE_PID" 2>/dev/null' EXIT   # let tee finish the log
log() { echo "[deepep $(date +%H:%M:%S)] $*"; }
SUMMARY="$OUTD/summary.txt"
summary() { echo "$*" >> "$SUMMARY"; log "SUMMARY: $*"; }
: > "$SUMMARY"

TARBALL="${DEEPEP_TARBALL:-wip/peers/DeepEP.tar.gz}"
WORK="${DEEPEP_WORK:-/tmp/deepep_peer}"
BUILD_TIMEOUT="${DEEPEP_BUILD_TIMEOUT:-420}"
TEST_TIMEOUT="${DEEPEP_TEST_TIMEOUT:-240}"
NUM_TOKENS="${DEEPEP_NUM_TOKENS:-128}"
# The lent machines require NVLink multicast off; keep it so for child processes.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
export PYTHONUNBUFFERED=1

# ---------------------------------------------------------------- (1) probe
log "host $(hostname) $(uname -r); repo $(pwd)"
if command -v nvcc >/dev/null; then log "nvcc: $(nvcc --version | tail -2 | tr '\n' ' ')"
elif [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; log "nvcc: $(nvcc --version | tail -2 | tr '\n' ' ')"
else log "nvcc: NOT FOUND"; fi
NGPU_SMI=$(timeout 30 nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
log "nvidia-smi -L: ${NGPU_SMI} GPU(s)"; timeout 30 nvidia-smi -L 2>&1 | sed 's/^/    /'
timeout 30 nvidia-smi topo -m > "$OUTD/topo.txt" 2>&1 && sed 's/^/    /' "$OUTD/topo.txt"

# Candidate pythons: explicit, PATH, common venv spots; only if none has a CUDA
# torch, a bounded find for site-packages/torch (interpreter derived from the path).
PY=""; TORCH_INFO=""; declare -A seen=()
probe() {  # probe each python given; the first whose torch sees CUDA becomes $PY
  local p r
  for p in "$@"; do
    [ -n "${seen[$p]:-}" ] && continue; seen[$p]=1
    [ -n "$PY" ] && { log "python $p (not probed: already have one)"; continue; }
    r=$(timeout 120 "$p" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count())' 2>/dev/null | tail -1)
    log "python $p -> torch: ${r:-none}"
    [ "$(echo "$r" | awk '{print $3}')" = "True" ] && { PY="$p"; TORCH_INFO="$r"; }
  done
}
cands=()
[ -n "${DEEPEP_PYTHON:-}" ] && cands+=("$DEEPEP_PYTHON")
for p in python3 python; do command -v "$p" >/dev/null && cands+=("$(command -v "$p")"); done
for p in /opt/torch/.venv/bin/python3 /opt/*/bin/python /opt/*/.venv/bin/python /opt/*/*/bin/python \
         /root/*venv*/bin/python /root/.*venv*/bin/python /root/*/.venv/bin/python \
         /venv*/bin/python /workspace/*/bin/python /usr/bin/python3 /usr/local/bin/python3; do
  [ -x "$p" ] && cands+=("$p")
done
probe "${cands[@]}"
if [ -z "$PY" ]; then
  cands=()
  while IFS= read -r tdir; do
    site=$(dirname "$tdir"); ver=$(echo "$site" | grep -o 'python3\.[0-9]*' | head -1)
    root="${site%/lib/python3*}"
    for p in "$root/bin/python" "$root/bin/python3" "$(command -v "${ver:-python3}" 2>/dev/null)"; do
      [ -n "$p" ] && [ -x "$p" ] && { cands+=("$p"); break; }
    done
  done < <(timeout 30 find / -maxdepth 7 \( -path /proc -o -path /sys -o -path /dev -o -path /run \) -prune \
             -o -type d -name torch -path '*-packages/torch' -print 2>/dev/null)
  [ ${#cands[@]} -gt 0 ] && probe "${cands[@]}"
fi
if [ -z "$PY" ]; then
  summary "SKIPPED: no python with a CUDA-enabled torch found (DeepEP needs PyTorch); nothing built."
  exit 0
fi
NGPU=$(echo "$TORCH_INFO" | awk '{print $4}')
log "using $PY (torch $TORCH_INFO); torch sees $NGPU GPU(s)"
timeout 60 "$PY" - <<'EOF' 2>&1 | sed 's/^/    /'
import importlib.util as u, sysconfig, os
for m in ("setuptools", "ninja", "nvidia.nvshmem", "nvidia.nccl"):
    print(f"{m}: {'yes' if u.find_spec(m) else 'no'}")
inc = sysconfig.get_paths()["include"]
print("Python.h:", inc, os.path.exists(os.path.join(inc, "Python.h")))
EOF

# ---------------------------------------------------------------- (2) build
if [ ! -f "$TARBALL" ]; then
  summary "SKIPPED: $TARBALL missing. Make it where the DeepEP mirror is (see wip/peers/README.md)."
  exit 0
fi
TMAJ=$(echo "$TORCH_INFO" | awk '{print $2}' | cut -d. -f1)
NMAJ=$(nvcc --version 2>/dev/null | grep -o 'release [0-9]*' | awk '{print $2}')
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
if [ -n "$TMAJ" ] && [ "$TMAJ" != "$NMAJ" ]; then   # torch's extension builder refuses a major mismatch
  for d in /usr/local/cuda-"$TMAJ"*; do [ -x "$d/bin/nvcc" ] && { CUDA_HOME="$d"; export PATH="$d/bin:$PATH"; break; }; done
  log "torch is CUDA $TMAJ, nvcc was $NMAJ -> CUDA_HOME=$CUDA_HOME (build may fail if no match)"
fi

# -lcuda needs an unversioned libcuda.so at link time. Use the toolkit's stub, else
# a link to the driver's libcuda.so.1, else an empty stub with that soname (all
# three leave NEEDED libcuda.so.1, so the driver's library is used at run time).
LCD="/tmp/deepep_peer_libcuda"
if [ -f "$CUDA_HOME/lib64/stubs/libcuda.so" ]; then LCD="$CUDA_HOME/lib64/stubs"
elif ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so '; then
  mkdir -p "$LCD"; real=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
  [ -z "$real" ] && real=$(ls /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 \
                              /usr/lib64/libcuda.so.1 /usr/local/cuda/compat/libcuda.so.1 2>/dev/null | head -1)
  if [ -n "$real" ]; then ln -sf "$real" "$LCD/libcuda.so"
  else  # empty stub defines no cu* symbol: keep it NEEDED anyway (ld defaults to --as-needed here)
    echo 'void jax_moe_libcuda_stub(void){}' | gcc -shared -fPIC -x c - -Wl,-soname,libcuda.so.1 -o "$LCD/libcuda.so"
    export LDFLAGS="${LDFLAGS:+$LDFLAGS }-Wl,--no-as-needed"; fi
  log "no libcuda.so for the linker; using $LCD/libcuda.so -> ${real:-empty stub}"
fi
[ -f "$LCD/libcuda.so" ] && export LIBRARY_PATH="${LIBRARY_PATH:+$LIBRARY_PATH:}$LCD"

# torch's ATen/cuda headers include cusparse.h/cublas_v2.h; if this toolkit lacks
# them, use the copies in the nvidia-* wheels beside torch (after the -I dirs).
if [ ! -f "$CUDA_HOME/include/cusparse.h" ]; then
  inc=$(timeout 60 "$PY" -c 'import nvidia, glob, os; print(":".join(sorted({os.path.dirname(f) for p in nvidia.__path__ for f in glob.glob(p + "/*/include/cusparse.h")})))' 2>/dev/null)
  [ -n "$inc" ] && export CPATH="${CPATH:+$CPATH:}$inc" && log "no cusparse.h in $CUDA_HOME; CPATH+=$inc"
fi

SUM=$(sha256sum "$TARBALL" | cut -c1-16)
SRC="$WORK/src"
if [ "${DEEPEP_FORCE_REBUILD:-0}" != 1 ] && [ "$(cat "$WORK/stamp" 2>/dev/null)" = "$SUM $PY" ] \
   && ls "$SRC"/deep_ep_cpp*.so >/dev/null 2>&1; then
  log "reusing build in $SRC (tarball $SUM unchanged)"
else
  rm -rf "$WORK"; mkdir -p "$SRC"
  tar -xzf "$TARBALL" -C "$SRC" || { summary "FAILED: cannot unpack $TARBALL"; exit 1; }
  # Accept tarballs with or without a top-level folder (git archive --prefix=...).
  if [ ! -f "$SRC/setup.py" ]; then
    sub=$(ls -d "$SRC"/*/ 2>/dev/null | head -1)
    [ -n "$sub" ] && [ -f "$sub/setup.py" ] && mv "$sub"* "$sub".[!.]* "$SRC"/ 2>/dev/null
  fi
  if [ ! -f "$SRC/csrc/deep_ep.cpp" ] || [ ! -f "$SRC/tests/test_intranode.py" ]; then
    summary "FAILED: $TARBALL is not DeepEP V1 (EPv2, DeepEP main since 2026-04, needs NVSHMEM+NCCL wheels and the fmt submodule). Use commit 567632d."
    exit 1
  fi
  # DeepEP >= c475ec6 calls three internode_ll:: helpers from deep_ep.cpp outside
  # its DISABLE_NVSHMEM guards; they live in internode_ll.cu, which a no-NVSHMEM
  # build skips, so the module would fail to import (undefined symbol). Add a
  # stub (our code) that throws if those shrink-mode APIs are ever called.
  STUB=""
  if grep -q 'internode_ll::update_mask_buffer' "$SRC/csrc/deep_ep.cpp"; then
    STUB="csrc/jax_moe_peer_stub.cpp"
    cat > "$SRC/$STUB" <<'EOF'
// Added by jax_moe wip/peers/deepep.sh (not DeepEP code): intranode-only build.
#include <cuda_runtime.h>
#include <stdexcept>
namespace deep_ep { namespace internode_ll {
[[noreturn]] static void no_nvshmem() { throw std::runtime_error("DeepEP built without NVSHMEM (jax_moe peer)"); }
void query_mask_buffer(int*, int, int*, cudaStream_t) { no_nvshmem(); }
void update_mask_buffer(int*, int, bool, cudaStream_t) { no_nvshmem(); }
void clean_mask_buffer(int*, int, cudaStream_t) { no_nvshmem(); }
}}  // namespace deep_ep::internode_ll
EOF
  fi
  # Build launcher: hide any nvidia-nvshmem wheel from DeepEP's setup.py so it takes
  # its "NVSHMEM disabled -> intranode only" path, add the stub, build in place.
  cat > "$WORK/build_peer.py" <<'EOF'
import importlib.util, os, runpy, sys
src, stub = sys.argv[1], sys.argv[2]
os.chdir(src); sys.path.insert(0, src); os.environ.pop("NVSHMEM_DIR", None)
_find = importlib.util.find_spec
importlib.util.find_spec = lambda n, *a, **k: None if n.startswith("nvidia.nvshmem") else _find(n, *a, **k)
if stub:
    import torch.utils.cpp_extension as ce
    _ext = ce.CUDAExtension
    def _with_stub(*a, **k):
        k["sources"] = list(k.get("sources", [])) + [stub]
        return _ext(*a, **k)
    ce.CUDAExtension = _with_stub
sys.argv = ["setup.py", "build_ext", "--inplace"]
runpy.run_path("setup.py", run_name="__main__")
EOF
  log "building DeepEP intranode-only in $SRC (timeout ${BUILD_TIMEOUT}s, stub: ${STUB:-none})"
  t0=$(date +%s)
  ( cd "$SRC" && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 DISABLE_SM90_FEATURES=0 CUDA_HOME="$CUDA_HOME" \
      timeout -k 10 "$BUILD_TIMEOUT" "$PY" "$WORK/build_peer.py" "$SRC" "$STUB" ) > "$OUTD/build.log" 2>&1
  rc=$?; log "build rc=$rc in $(( $(date +%s) - t0 ))s (log: $OUTD/build.log)"; tail -n 25 "$OUTD/build.log" | sed 's/^/    /'
  if [ $rc -ne 0 ] || ! ls "$SRC"/deep_ep_cpp*.so >/dev/null 2>&1; then
    summary "FAILED: DeepEP build (rc=$rc; 124 = timeout). See build.log."; exit 1
  fi
  echo "$SUM $PY" > "$WORK/stamp"
fi
imp=$(cd "$SRC" && PYTHONPATH="$SRC" timeout 120 "$PY" -c 'import deep_ep; print("sm90:", deep_ep.Buffer.is_sm90_compiled())' 2>&1)
log "import deep_ep: $(echo "$imp" | tail -3)"
echo "$imp" | grep -q '^sm90:' || { summary "FAILED: built module does not import: $(echo "$imp" | tail -1)"; exit 1; }

# ---------------------------------------------------------------- (3) run
# DeepEP intranode kernels exist only for 2, 4 or 8 ranks (SWITCH_RANKS in
# csrc/kernels/launch.cuh), one process per GPU (NCCL refuses two ranks on one GPU).
NPROC=0; for n in 8 4 2; do [ "$NGPU" -ge "$n" ] && { NPROC=$n; break; }; done
if [ "$NPROC" -eq 0 ]; then
  summary "SKIPPED run: $NGPU GPU(s). DeepEP intranode needs 2, 4 or 8 GPUs (1 rank is unsupported); build + import OK."
  exit 0
fi
[ "$NPROC" -ne "$NGPU" ] && log "using $NPROC of $NGPU GPUs (DeepEP supports 2/4/8 ranks)"
run_test() {  # $1 = tokens per rank, $2 = log name
  log "test_intranode: $NPROC ranks, $1 tokens/rank, hidden 7168, 256 experts, top-8 (timeout ${TEST_TIMEOUT}s)"
  ( cd "$SRC" && PYTHONPATH="$SRC" MASTER_PORT="${MASTER_PORT:-8361}" timeout -k 15 "$TEST_TIMEOUT" \
      "$PY" tests/test_intranode.py --num-processes "$NPROC" --num-tokens "$1" \
      --hidden 7168 --num-topk 8 --num-experts 256 ) > "$OUTD/$2" 2>&1
  local rc=$?
  grep -E '^\[(config|layout)\]|Best (dispatch|combine)' "$OUTD/$2" | sed 's/^/    /'
  if [ $rc -eq 0 ]; then
    summary "OK $NPROC GPUs, $1 tok/rank: $(grep -E 'Best (dispatch|combine)' "$OUTD/$2" | sed 's/.*Best //' | tr '\n' ';')"
  else
    summary "FAILED test_intranode $1 tok/rank rc=$rc (124 = timeout); see $2"; tail -n 30 "$OUTD/$2" | sed 's/^/    /'
  fi
  return $rc
}
run_test "$NUM_TOKENS" "test_intranode_${NUM_TOKENS}.log"; status=$?
[ "${DEEPEP_PREFILL:-0}" = 1 ] && { run_test 4096 test_intranode_4096.log || status=1; }
log "low-latency mode (tests/test_low_latency.py) not run: it needs NVSHMEM with IBGDA (RDMA NICs)."
exit $status

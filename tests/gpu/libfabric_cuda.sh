#!/usr/bin/env bash
# Builds libfabric 2.6 with CUDA (shm, tcp, rxm; CUDA dlopened) from the vendored tarball into PREFIX:
#   bash tests/gpu/libfabric_cuda.sh PREFIX [TARBALL]
# TARBALL defaults to third_party_headers/vendor/libfabric-2.6.0-src.tgz (copied from ../shared/vendor/). On the GPU
# machine `device_run.sh hmem` runs it (~30 s); here it builds the library ahead into third_party_headers/lfi, which
# the call then carries (DEVELOPERS.md). A machine without nvml.h (NVML comes with the driver, not the toolkit) gets a
# stub header: libfabric dlopens NVML and only needs the declarations to compile.
set -euo pipefail
PREFIX=${1:?usage: libfabric_cuda.sh PREFIX [TARBALL]}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TARBALL=${2:-$ROOT/third_party_headers/vendor/libfabric-2.6.0-src.tgz}
CUDA=${CUDA_HOME:-/usr/local/cuda}
WORK=$(mktemp -d /tmp/lfb.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$PREFIX"
PREFIX=$(cd "$PREFIX" && pwd)
tar -xzf "$TARBALL" -C "$WORK"
cppflags=""
if [ ! -e "$CUDA/include/nvml.h" ] && [ ! -e /usr/include/nvml.h ]; then
  mkdir -p "$WORK/stub"
  cat > "$WORK/stub/nvml.h" <<'STUB'
#pragma once
typedef int nvmlReturn_t;
typedef struct nvmlDevice_st* nvmlDevice_t;
#define NVML_SUCCESS 0
nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlShutdown(void);
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int, nvmlDevice_t*);
STUB
  cppflags="-I$WORK/stub"
fi
cd "$WORK/lf"
# The man pages go to the scratch folder (not needed, and they count against what a device call carries): never a
# deletion under PREFIX, which may be a shared prefix such as /usr/local.
CPPFLAGS="$cppflags" ./configure -q --prefix="$PREFIX" --datarootdir="$WORK/share" --with-cuda="$CUDA" --enable-cuda-dlopen --enable-shm \
  --enable-tcp --enable-rxm --disable-efa --disable-verbs --disable-psm2 --disable-psm3 --disable-opx --disable-usnic \
  --disable-ucx --disable-lpp --disable-sockets --disable-udp --disable-mrail --disable-hook_debug --disable-hook_hmem \
  --disable-dmabuf_peer_mem > "$WORK/configure.log" 2>&1 || { tail -30 "$WORK/configure.log"; exit 1; }
grep -q "define HAVE_CUDA 1" config.h || { echo "libfabric_cuda.sh: configure found no CUDA in $CUDA" >&2; exit 1; }
make -s -j"$(nproc)" install > "$WORK/make.log" 2>&1 || { tail -30 "$WORK/make.log"; exit 1; }
echo "libfabric 2.6 with CUDA in $PREFIX"

# shellcheck shell=bash
# The CUDA compiler of the build environment, sourced after env.sh by scripts/cuda-check.
#
# The sid environment holds every dependency of the tests (Catch2 3, Google Benchmark, ...), but the
# CUDA Toolkit 13.0 of Debian 12 machines fails there: sid's glibc 2.43 declares rsqrt/rsqrtf with
# another exception specification than CUDA 13.0's math_functions.h, and nvcc 13.0 takes host GCC up
# to 15 only (sid has 16). NVIDIA's CUDA 13.5 compiler, published as Python wheels on PyPI, works with
# both. We install those wheels by package name and pinned version, with this machine's own pip
# (configured for its package index), into /opt/kvmem-cuda inside the sid root; nothing is downloaded
# from anywhere else. Two files no wheel ships are added: the unversioned libcudart.so link that CMake's
# FindCUDAToolkit looks for, a cccl/include link where CCCL's CMake package looks for its headers, and the CUDA driver stub libcuda.so (for CUDA::cuda_driver, linked by
# Kokkos' exported targets), copied from a CUDA Toolkit on the host (KVMEM_CUDA_DRIVER_STUB,
# /usr/local/cuda/lib64/stubs/libcuda.so by default). The real driver comes from the GPU machine.

# PyPI packages of the compiler, pinned. Changing this list reinstalls the compiler at the next use.
KVMEM_CUDA_WHEELS="nvidia-cuda-nvcc==13.5.37 nvidia-cuda-crt==13.5.37 nvidia-cuda-runtime==13.5.37 nvidia-nvvm==13.5.37 nvidia-cuda-cccl==13.3.5.0.6"
# Where the wheels go, as seen inside the sid root; the toolkit tree (bin/nvcc, include, lib, nvvm) is
# KVMEM_CUDA_HOME.
KVMEM_CUDA_PREFIX=/opt/kvmem-cuda
KVMEM_CUDA_HOME=$KVMEM_CUDA_PREFIX/nvidia/cu13
KVMEM_CUDA_DRIVER_STUB=${KVMEM_CUDA_DRIVER_STUB:-/usr/local/cuda/lib64/stubs/libcuda.so}

# Make sure the sid root has the CUDA compiler; install it otherwise (about 350 MB unpacked, a minute).
kvmem_cuda_ensure() {
  kvmem_env_ensure || return 1
  local root=$KVMEM_ENV_ROOT
  [ "$KVMEM_ENV" = host ] && root=""
  local prefix=$root$KVMEM_CUDA_PREFIX home=$root$KVMEM_CUDA_HOME stamp=$root$KVMEM_CUDA_PREFIX/.kvmem-cuda
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$KVMEM_CUDA_WHEELS" ]; then return 0; fi
  if [ ! -f "$KVMEM_CUDA_DRIVER_STUB" ]; then
    kvmem_log "no CUDA driver stub at $KVMEM_CUDA_DRIVER_STUB (a CUDA Toolkit's lib64/stubs/libcuda.so);" \
      "set KVMEM_CUDA_DRIVER_STUB to one"
    return 1
  fi
  kvmem_log "installing the CUDA compiler ($KVMEM_CUDA_WHEELS) into $prefix"
  rm -rf "$prefix.tmp"
  # shellcheck disable=SC2086  # the list is words on purpose
  if ! python3 -m pip install --quiet --no-deps --no-compile --disable-pip-version-check --target "$prefix.tmp" \
      $KVMEM_CUDA_WHEELS >"$root/var/log/kvmem-cuda.log" 2>&1; then
    kvmem_log "pip failed; see $root/var/log/kvmem-cuda.log"; tail -n 20 "$root/var/log/kvmem-cuda.log" >&2; return 1
  fi
  local tmphome=$prefix.tmp/nvidia/cu13
  if [ ! -x "$tmphome/bin/nvcc" ] || [ ! -f "$tmphome/lib/libcudart.so.13" ]; then
    kvmem_log "the CUDA wheels did not give $tmphome/bin/nvcc and lib/libcudart.so.13"; return 1
  fi
  ln -sf libcudart.so.13 "$tmphome/lib/libcudart.so"
  # The CCCL wheel's CMake package looks for its headers in cccl/include; the wheels put them in include/cccl.
  ln -sfn ../include "$tmphome/cccl/include"
  mkdir -p "$tmphome/lib/stubs"
  cp "$KVMEM_CUDA_DRIVER_STUB" "$tmphome/lib/stubs/libcuda.so"
  rm -rf "$prefix"
  mv "$prefix.tmp" "$prefix"
  printf '%s' "$KVMEM_CUDA_WHEELS" >"$stamp"
  [ -d "$home" ] || return 1
}

# Run a command in the environment with the CUDA compiler on PATH (CUDA_HOME, CUDAToolkit_ROOT set).
kvmem_in_cuda_env() {
  kvmem_cuda_ensure || return 1
  kvmem_in_env env PATH="$KVMEM_CUDA_HOME/bin:/usr/local/bin:/usr/bin:/bin" CUDA_HOME="$KVMEM_CUDA_HOME" \
    CUDAToolkit_ROOT="$KVMEM_CUDA_HOME" "$@"
}

# Whether $1 is the install prefix of a Kokkos with the Cuda backend (its KokkosCore_config.h says so).
kvmem_kokkos_has_cuda() {
  [ -n "${1:-}" ] && grep -qs '^#define KOKKOS_ENABLE_CUDA$' "$1/include/KokkosCore_config.h"
}

# Configure the build directory $2 of kvmem against the Kokkos with Cuda at $1, with Kokkos' nvcc_wrapper
# as the C++ compiler (once; later calls only pass the options again); further arguments go to CMake.
kvmem_cuda_configure() {
  local prefix=$1 build=$2
  shift 2
  if [ -f "$build/build.ninja" ]; then  # configured: only the options may change (a few seconds)
    (cd "$KVMEM_REPO" && kvmem_in_cuda_env cmake -S . -B "$build" "$@" >/dev/null)
    return
  fi
  (cd "$KVMEM_REPO" && kvmem_in_cuda_env cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_COMPILER="$prefix/bin/nvcc_wrapper" -DKokkos_ROOT="$prefix" "$@")
}

# FlashInfer's header templates (the readout on tensor cores, CMake option KVMEM_FLASHINFER): its Python
# wheel, pinned to the version kvmem instantiates (cmake/kvmemFlashInfer.cmake checks it), installed by
# package name with this machine's own pip into KVMEM_FLASHINFER_PREFIX inside the sid root, without its
# dependencies (only the headers under flashinfer/data are used; about 60 MB).
KVMEM_FLASHINFER_WHEEL="flashinfer-python==0.7.2.post1"
KVMEM_FLASHINFER_PREFIX=/opt/kvmem-flashinfer
kvmem_flashinfer_ensure() {
  kvmem_env_ensure || return 1
  local root=$KVMEM_ENV_ROOT
  [ "$KVMEM_ENV" = host ] && root=""
  local prefix=$root$KVMEM_FLASHINFER_PREFIX stamp=$root$KVMEM_FLASHINFER_PREFIX/.kvmem-flashinfer
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$KVMEM_FLASHINFER_WHEEL" ]; then return 0; fi
  kvmem_log "installing FlashInfer's headers ($KVMEM_FLASHINFER_WHEEL, no dependencies) into $prefix"
  rm -rf "$prefix.tmp"
  if ! python3 -m pip install --quiet --no-deps --no-compile --disable-pip-version-check --target "$prefix.tmp" \
      "$KVMEM_FLASHINFER_WHEEL" >"$root/var/log/kvmem-flashinfer.log" 2>&1; then
    kvmem_log "pip failed; see $root/var/log/kvmem-flashinfer.log"; tail -n 20 "$root/var/log/kvmem-flashinfer.log" >&2
    return 1
  fi
  rm -rf "$prefix"
  mv "$prefix.tmp" "$prefix"
  printf '%s' "$KVMEM_FLASHINFER_WHEEL" >"$stamp"
}

# Compile the readout on tensor cores (src/backend/cuda/flashinfer_readout.cu, the one translation unit that
# instantiates FlashInfer's templates; it includes no Kokkos header) with nvcc alone, for the GPU
# architecture $1 (default sm_90): the check of the FlashInfer path where no Kokkos with Cuda is installed
# (CI). Warnings are errors on kvmem's code; FlashInfer's headers and its bundled CCCL come first as system
# headers -- the include folders and flags that cmake/kvmemFlashInfer.cmake gives this file (keep the two
# in step). Host code at -O1, as scripts/cuda-check compiles it. Nothing is linked.
kvmem_flashinfer_compile_check() {
  local arch=${1:-sm_90}
  kvmem_flashinfer_ensure || return 1
  local data=$KVMEM_FLASHINFER_PREFIX/flashinfer/data object=/tmp/kvmem-flashinfer-check.$$.o
  (cd "$KVMEM_REPO" && kvmem_in_cuda_env nvcc -std=c++20 -arch="$arch" -O1 --expt-relaxed-constexpr \
    -Werror all-warnings -Xcompiler=-Wall,-Wextra,-Werror -DNDEBUG -Iinclude \
    -isystem "$data/include" -isystem "$data/cccl/libcudacxx/include" -isystem "$data/cccl/cub" \
    -isystem "$data/cccl/thrust" -c src/backend/cuda/flashinfer_readout.cu -o "$object")
  local rc=$?
  kvmem_in_env rm -f "$object"
  return "$rc"
}

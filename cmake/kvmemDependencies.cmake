# Kokkos >= 4.5 (4.x or 5.x). Kokkos' own version file accepts only its major version, so the
# minimum is checked here instead of in find_package.
set(KVMEM_KOKKOS_MIN_VERSION 4.5)
find_package(Kokkos REQUIRED)
if(Kokkos_VERSION VERSION_LESS KVMEM_KOKKOS_MIN_VERSION)
  message(FATAL_ERROR "kvmem needs Kokkos >= ${KVMEM_KOKKOS_MIN_VERSION}; found ${Kokkos_VERSION} at ${Kokkos_DIR}")
endif()

# With Kokkos' Cuda backend, the CUB/Thrust fast paths (include/kvmem/backend/cuda/) use CCCL from the CUDA
# Toolkit: find_package(CCCL) in the toolkit's CMake folder (lib64/cmake in an installed toolkit,
# cccl/lib/cmake in NVIDIA's PyPI wheels). KVMEM_HAS_CUDA tells the rest of the build.
set(KVMEM_HAS_CUDA OFF)
if("CUDA" IN_LIST Kokkos_DEVICES)
  set(KVMEM_HAS_CUDA ON)
  find_package(CUDAToolkit REQUIRED)
  find_package(CCCL CONFIG REQUIRED
               HINTS "${CUDAToolkit_LIBRARY_DIR}/cmake" "${CUDAToolkit_LIBRARY_ROOT}/cccl/lib/cmake"
                     "${CUDAToolkit_LIBRARY_DIR}/../cccl/lib/cmake")
endif()

# nlohmann-json (header-only): the safetensors reader (include/kvmem/io/safetensors.hpp) that loads the
# KVPOP scorer's weights, reached from kvmem.hpp through policy/score/mlstm.hpp. Linked to kvmem::kvmem
# when its CMake package is found; otherwise its header must be on the compiler's default include path.
find_package(nlohmann_json 3 QUIET)
set(KVMEM_WITH_NLOHMANN_JSON ${nlohmann_json_FOUND})

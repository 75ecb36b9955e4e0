# The readout on tensor cores through FlashInfer's header templates (docs/cuda.md, "Tensor cores"): with
# KVMEM_FLASHINFER=ON in a build against a Kokkos with the Cuda backend, kvmem::flashinfer is the one
# translation unit that instantiates FlashInfer's FA2 paged prefill for kvmem's readout
# (src/backend/cuda/flashinfer_readout.cu), and kvmem::kvmem links it and defines KVMEM_WITH_FLASHINFER for
# every target, so that every translation unit sees the same Memory. FlashInfer's C++ API changes between
# releases: the version is pinned (KVMEM_FLASHINFER_VERSION) and checked against the installed distribution.
#
# The headers come with FlashInfer's Python wheel (flashinfer-python, py3-none-any, Apache-2.0), e.g.
#   python3 -m pip install --no-deps --target <dir> flashinfer-python==0.7.2.post1
# KVMEM_FLASHINFER_ROOT is the folder that holds its `flashinfer/` package and its dist-info (a site-packages
# or a pip --target folder); when empty it is asked of python3 (importlib.metadata, without importing
# flashinfer, which would need PyTorch). The wheel's bundled CCCL (>= 3.5: cuda::fast_mod_div) comes ahead
# of the CUDA Toolkit's for this translation unit only.
option(KVMEM_FLASHINFER "Run the readout of 16-bit memories on Kokkos::Cuda on tensor cores through FlashInfer's
       header templates (needs a Cuda build and FlashInfer's Python distribution, see KVMEM_FLASHINFER_ROOT)" OFF)
set(KVMEM_FLASHINFER_ROOT "" CACHE PATH
    "Folder holding FlashInfer's Python package (flashinfer/data/include) and its dist-info; empty: asked of python3")
set(KVMEM_FLASHINFER_VERSION 0.7.2.post1)

if(NOT KVMEM_FLASHINFER)
  return()
endif()
if(NOT KVMEM_HAS_CUDA)
  message(FATAL_ERROR "KVMEM_FLASHINFER=ON needs a Kokkos with the Cuda backend; the Kokkos at ${Kokkos_DIR} "
                      "has the devices '${Kokkos_DEVICES}'")
endif()
set(root "${KVMEM_FLASHINFER_ROOT}")
if(NOT root)
  find_package(Python3 COMPONENTS Interpreter)
  if(Python3_FOUND)
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -c
              "import importlib.metadata as m; print(m.distribution('flashinfer-python').locate_file(''))"
      OUTPUT_VARIABLE root OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
endif()
set(install_hint "install it with: python3 -m pip install --no-deps --target <dir> flashinfer-python==${KVMEM_FLASHINFER_VERSION} and set -DKVMEM_FLASHINFER_ROOT=<dir>")
if(NOT root OR NOT EXISTS "${root}/flashinfer/data/include/flashinfer/attention/prefill.cuh")
  message(FATAL_ERROR "KVMEM_FLASHINFER=ON: no FlashInfer headers found (KVMEM_FLASHINFER_ROOT='${root}' has no "
                      "flashinfer/data/include/flashinfer/attention/prefill.cuh); ${install_hint}")
endif()
file(GLOB dist_info LIST_DIRECTORIES true "${root}/flashinfer_python-*.dist-info")
set(found_version "")
if(dist_info)
  list(GET dist_info 0 first)
  get_filename_component(name "${first}" NAME)
  string(REGEX REPLACE "^flashinfer_python-(.*)\\.dist-info$" "\\1" found_version "${name}")
endif()
if(NOT found_version STREQUAL KVMEM_FLASHINFER_VERSION)
  message(FATAL_ERROR "KVMEM_FLASHINFER=ON: kvmem instantiates FlashInfer ${KVMEM_FLASHINFER_VERSION}'s C++ templates, "
                      "but ${root} holds version '${found_version}' (from its flashinfer_python-*.dist-info); ${install_hint}")
endif()
set(data "${root}/flashinfer/data")
message(STATUS "kvmem: the readout on tensor cores through FlashInfer ${found_version} at ${data}/include")

add_library(kvmem_flashinfer STATIC src/backend/cuda/flashinfer_readout.cu)
add_library(kvmem::flashinfer ALIAS kvmem_flashinfer)
# Position-independent: the static library links into shared objects too (the Python module, an engine's
# own shared library), which a non-PIC archive cannot join (ld: "recompile with -fPIC").
set_target_properties(kvmem_flashinfer PROPERTIES POSITION_INDEPENDENT_CODE ON)
# nvcc_wrapper is the C++ compiler of a Cuda build of Kokkos; it compiles .cu files as CUDA.
set_source_files_properties(src/backend/cuda/flashinfer_readout.cu PROPERTIES LANGUAGE CXX)
target_compile_features(kvmem_flashinfer PRIVATE cxx_std_20)
target_include_directories(kvmem_flashinfer PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/include)
target_include_directories(kvmem_flashinfer SYSTEM BEFORE PRIVATE ${data}/include ${data}/cccl/libcudacxx/include
                                                                   ${data}/cccl/cub ${data}/cccl/thrust)
# Kokkos for its compile flags (the GPU architecture, the CUDA language); no Kokkos header is included.
target_link_libraries(kvmem_flashinfer PRIVATE Kokkos::kokkos)
target_compile_options(kvmem_flashinfer PRIVATE --expt-relaxed-constexpr)
target_compile_definitions(kvmem_flashinfer PUBLIC KVMEM_WITH_FLASHINFER)
target_link_libraries(kvmem INTERFACE kvmem_flashinfer)
if(NOT SKBUILD)
  install(TARGETS kvmem_flashinfer EXPORT kvmemTargets)
endif()

# Kokkos >= 4.5 (4.x or 5.x). Kokkos' own version file accepts only its major version, so the
# minimum is checked here instead of in find_package.
set(KVMEM_KOKKOS_MIN_VERSION 4.5)
find_package(Kokkos REQUIRED)
if(Kokkos_VERSION VERSION_LESS KVMEM_KOKKOS_MIN_VERSION)
  message(FATAL_ERROR "kvmem needs Kokkos >= ${KVMEM_KOKKOS_MIN_VERSION}; found ${Kokkos_VERSION} at ${Kokkos_DIR}")
endif()

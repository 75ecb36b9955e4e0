# kvmem_run_kvm: `kvmem-run kvm` (run_kvm) instantiated for each storage type of the tokens, one translation
# unit each (commands.hpp). kvmem-run and the kvm_input fuzz target (tests/fuzz) both link it, so a build
# compiles these instantiations once, whichever of the two it builds; included by both CMakeLists.txt files.
if(NOT TARGET kvmem_run_kvm)
  add_library(kvmem_run_kvm STATIC ${CMAKE_CURRENT_LIST_DIR}/run_kvm_f32.cpp ${CMAKE_CURRENT_LIST_DIR}/run_kvm_bf16.cpp
                                   ${CMAKE_CURRENT_LIST_DIR}/run_kvm_f16.cpp)
  target_link_libraries(kvmem_run_kvm PUBLIC kvmem::kvmem nlohmann_json::nlohmann_json CLI11::CLI11)
  target_include_directories(kvmem_run_kvm PUBLIC ${CMAKE_CURRENT_LIST_DIR}/..)
  if(KVMEM_BUILD_FUZZ)
    # libFuzzer's coverage of the whole input path, as when the fuzz target compiled run_kvm itself.
    target_compile_options(kvmem_run_kvm PRIVATE -fsanitize=fuzzer-no-link)
  endif()
endif()

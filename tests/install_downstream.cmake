# Installs kvmem from KVMEM_BUILD into WORK/prefix, then configures, builds and runs
# examples/downstream against it (with the Kokkos and nlohmann-json that the build found), as a user's own
# project would.
file(REMOVE_RECURSE ${WORK})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${KVMEM_BUILD} --prefix ${WORK}/prefix COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND ${CMAKE_COMMAND} -S ${KVMEM_SOURCE}/examples/downstream -B ${WORK}/build -G ${GENERATOR}
                        -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_PREFIX_PATH=${WORK}/prefix -DCMAKE_BUILD_TYPE=Release
                        -DKokkos_DIR=${KOKKOS_DIR} -Dnlohmann_json_DIR=${NLOHMANN_JSON_DIR}
                COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK}/build COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND ${WORK}/build/downstream COMMAND_ERROR_IS_FATAL ANY)

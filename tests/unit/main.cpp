// Catch2 entry point that initializes Kokkos once for every test case.
#include <Kokkos_Core.hpp>
#include <catch2/catch_session.hpp>

int main(int argc, char** argv) {
  Kokkos::ScopeGuard guard;
  return Catch::Session().run(argc, argv);
}

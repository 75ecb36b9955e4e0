#pragma once
// Which kernels a call ran, seen from outside: launches of a Kokkos kernel by its label, counted with a
// Kokkos Tools callback in this process (Kokkos::Tools is always built in Kokkos >= 4). The split-KV tests
// read it to see that a decode step asked to split (DecodeSplits::always) did run its split kernel, which
// gives the same bits as the unsplit readout and so cannot be told apart by the outputs.
#include <Kokkos_Core.hpp>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvmem_test {

/// Counts the launches (parallel_for) of the kernel labelled `label` from construction to destruction; puts
/// the callbacks installed before (none, or a tool's) back at destruction, also when an assertion throws.
/// One at a time: a second one alive at once is a std::logic_error.
class KernelLaunches {
 public:
  explicit KernelLaunches(std::string label) : saved_(Kokkos::Tools::Experimental::get_callbacks()) {
    if (active_ != nullptr) throw std::logic_error("kvmem_test::KernelLaunches: one counter at a time");
    label_ = std::move(label);
    active_ = this;
    Kokkos::Tools::Experimental::set_begin_parallel_for_callback(on_kernel);
  }
  ~KernelLaunches() {
    Kokkos::Tools::Experimental::set_callbacks(saved_);
    active_ = nullptr;
  }
  KernelLaunches(const KernelLaunches&) = delete;
  KernelLaunches& operator=(const KernelLaunches&) = delete;

  /// Launches of the kernel so far.
  [[nodiscard]] long count() const { return count_; }

 private:
  static void on_kernel(const char* name, std::uint32_t, std::uint64_t*) {
    if (active_ != nullptr && active_->label_ == name) ++active_->count_;
  }

  inline static KernelLaunches* active_ = nullptr;
  Kokkos::Tools::Experimental::EventSet saved_;
  std::string label_;
  long count_ = 0;
};

}  // namespace kvmem_test

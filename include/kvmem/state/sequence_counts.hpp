#pragma once
/// \file sequence_counts.hpp
/// Per-sequence counts that live on the device beside the state (tokens seen, a step's token counts), with
/// the host's copy of them: a decode step reads and advances them on the device, so it needs no plan, no
/// copy and no fence from the host (docs/cuda.md, "A decode step: plan once, run many").

#include <Kokkos_Core.hpp>
#include <span>
#include <string>
#include <type_traits>

#include "../errors.hpp"

namespace kvmem::state {

/// Whether kernels of a memory space run on the host thread's memory: there the host's copy of a count is
/// the device's, and the host plans a step in place (OpenMP, Serial, Threads). Elsewhere (Cuda) the device
/// advances its own counts with a kernel and the host keeps a separate copy.
template <class MemorySpace>
inline constexpr bool host_is_device = std::is_same_v<MemorySpace, Kokkos::HostSpace>;

/// B values of type T (a plain struct or an integer), one per sequence, on the device of `MemorySpace`
/// and on the host.
/// - On a host memory space both are one view (shared()): what the host writes the kernels read, unless
///   keep_apart() gave the host a copy of its own (the GPU's arrangement, for testing its path on a CPU).
/// - Elsewhere the host writes its copy and upload() sends it, only when it changed since the last upload
///   (set() or mark_changed() record a change); a kernel that advances the device's values on its own is
///   recorded with device_advanced(), and sync() brings them back (one fence and one copy). A captured
///   CUDA graph may replay such a kernel without the host knowing, so from the first device_advanced()
///   until forget_replays() every sync() reads the device's values back; ahead() says only whether the host
///   launched such a kernel since the last sync().
template <class T, class MemorySpace>
class SequenceCounts {
 public:
  using device_view = Kokkos::View<T*, MemorySpace>;
  using host_view = Kokkos::View<T*, Kokkos::HostSpace>;

  /// Allocates B = `batch` values labelled `label`, each `init`, on both sides (one view on a host memory
  /// space again: allocate after keep_apart() undoes it).
  void allocate(const std::string& label, long batch, const T& init) {
    device_ = device_view(label, batch);
    shared_ = host_is_device<MemorySpace>;
    if constexpr (host_is_device<MemorySpace>)
      host_ = device_;
    else
      host_ = host_view(label + " (host)", batch);
    for (long b = 0; b < batch; ++b) host_(b) = init;
    changed_ = !shared_;
    ahead_ = replayable_ = false;
  }
  /// Gives the host a copy of its own on a host memory space, as on a GPU: from then on upload() copies,
  /// device_advanced() leaves the host behind and sync() reads back. The values stay. Nothing changes where
  /// the two are already apart. Must not be called while the device is ahead().
  void keep_apart() {
    if (!shared_) return;  // (shared, the device is never ahead: device_advanced() records nothing)
    host_view copy(device_.label() + " (host)", size());
    Kokkos::deep_copy(copy, host_);
    host_ = copy;
    shared_ = false;
    changed_ = true;
  }
  /// Whether the host's values and the device's are one view (a host memory space, unless keep_apart()).
  [[nodiscard]] bool shared() const { return shared_; }
  [[nodiscard]] long size() const { return static_cast<long>(host_.extent(0)); }
  /// The host's value of sequence b (exact unless ahead()).
  [[nodiscard]] const T& host(long b) const { return host_(b); }
  /// Writable host value; a write through it is sent by the next upload() only after mark_changed().
  [[nodiscard]] T& host(long b) { return host_(b); }
  [[nodiscard]] const device_view& device() const { return device_; }
  /// Sets the host value of sequence b and records a change when it differs.
  void set(long b, const T& value) {
    if (host_(b) == value) return;
    host_(b) = value;
    changed_ = !shared_;
  }
  /// Records that host values were written through host(b) and must be sent.
  void mark_changed() { changed_ = !shared_; }
  /// Sends the host values to the device if they changed since the last upload: one deep copy, none on a
  /// host memory space or when nothing changed.
  template <class ExecSpace>
  void upload(const ExecSpace& exec) {
    if (!changed_) return;
    Kokkos::deep_copy(exec, device_, host_);
    changed_ = false;
  }
  /// Records that a kernel advanced the device values without the host (decode_async): the host's copy is
  /// behind until sync(). Nothing to record on a host memory space, where both are one view.
  void device_advanced() { ahead_ = replayable_ = !shared_; }
  [[nodiscard]] bool ahead() const { return ahead_; }
  /// Whether the device's values may have moved without the host (since the first device_advanced()).
  [[nodiscard]] bool replayable() const { return replayable_; }
  /// Ends replayable(): the host has just set every value and sent it (a reset).
  void forget_replays() { ahead_ = replayable_ = false; }
  /// When replayable(): waits for `exec` (fence `label`) and copies the device values to the host.
  template <class ExecSpace>
  void sync(const ExecSpace& exec, const std::string& label) {
    if (!replayable_) return;
    exec.fence(label);
    Kokkos::deep_copy(host_, device_);
    ahead_ = false;
  }

 private:
  device_view device_;
  host_view host_;
  bool shared_ = host_is_device<MemorySpace>, changed_ = false, ahead_ = false, replayable_ = false;
};

/// keep_apart() and upload() of every count given: the memories' plan_on_device(), which makes a host backend
/// keep its counts as a GPU does.
template <class ExecSpace, class... Counts>
void keep_apart(const ExecSpace& exec, Counts&... counts) {
  ((counts.keep_apart(), counts.upload(exec)), ...);
}

/// A decode step's active set: flags(b) = 1 for every sequence b with active[b] != 0 (all when `active` is
/// empty), 0 otherwise, sent to the device with one copy when they changed. Throws kvmem::invalid_argument,
/// before any flag changes, for an `active` whose size is neither 0 nor the batch.
template <class MemorySpace, class ExecSpace>
void set_active(SequenceCounts<long, MemorySpace>& flags, std::span<const unsigned char> active, const ExecSpace& exec) {
  if (!active.empty() && static_cast<long>(active.size()) != flags.size())
    throw invalid_argument(
        detail::describe("active.size()", active.size(), "must equal the batch size " + std::to_string(flags.size())));
  for (long b = 0; b < flags.size(); ++b) flags.set(b, active.empty() || active[b] ? 1L : 0L);
  flags.upload(exec);
}

}  // namespace kvmem::state

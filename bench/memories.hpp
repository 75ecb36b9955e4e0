#pragma once
// The memories the benchmarks time, each behind one adapter that bench_prefill.cpp and bench_decode.cpp
// run without knowing the family, with each family's work model (FLOPs and bytes, counted from the
// host-side schedule the memory follows; bench/README.md) and one registration helper per family.
//
// An adapter, built by a family's factory from the shape and the execution-space instance, has
//   model                               the work model: Work prefill(T), Work step() (the next decode step),
//                                       rows() (checked against the memory's after a run)
//   prepare(Inputs&)                    adds the family's own inputs (Trellis) to the random inputs
//   prefill(const Inputs&)              the whole prompt, into an empty memory
//   decode(const Inputs&, long i)       token i of the inputs, one decode step
//   reset(), held_bytes(), rows()       empty it; bytes held; rows of sequence 0 (state, slots or cache)
//   readout_kernels(), update_kernels() Kokkos kernel-name prefixes (KernelClock) of its readout and
//                                       update; empty where one kernel does both (eviction)

#include "common.hpp"

#include <kvmem/memory_concept.hpp>

#include <type_traits>
#include <utility>

namespace kvbench {

/// What every adapter does alike, through the one memory contract (kvmem::AttentionMemory): the prompt into
/// the memory, token i as a decode step, reset and held bytes. A family's adapter derives from it and gives
/// `inputs_of(const Inputs&)`, the benchmark's random tensors as the memory's inputs (M::inputs).
template <kvmem::AttentionMemory M, class Family>
struct ContractAdapter {
  M mem;

  template <class... Args>
  explicit ContractAdapter(Args&&... args) : mem(std::forward<Args>(args)...) {}
  void prefill(const Inputs& in) { mem.prefill(family().inputs_of(in), in.y); }
  void decode(const Inputs& in, long i) { mem.decode(family().inputs_of(in).token(i), token(in.y, i)); }
  void reset() { mem.reset(); }
  [[nodiscard]] long held_bytes() const { return mem.held_bytes(); }

 private:
  [[nodiscard]] const Family& family() const { return static_cast<const Family&>(*this); }
};

// ---------------------------------------------------------------------------------------------------
// Series: which memories a shape registers, as a set of bits (the programs register exact attention and
// the float64 reference themselves; the families below the rest).

enum Series : unsigned {
  kExact = 1u << 0,
  kReference = 1u << 1,
  kKvmFixed = 1u << 2,      // kvm-fixed256
  kKvmPowerLaw = 1u << 3,   // kvm-power-law
  kKvmH2oRows = 1u << 4,    // kvm-power-law-h2o256: KVM power-law, state rows evicted by H2O above 256
  kOvq = 1u << 5,           // ovq-plateau256
  kTrellis = 1u << 6,       // trellis-m64 (registered only where G = 1: Trellis has no GQA)
  kEvictH2o = 1u << 7,      // evict-h2o256
  kEvictOthers = 1u << 8,   // evict-streaming256, evict-knorm256, evict-tova256, evict-kvpop256
  kExactUnsplit = 1u << 9,  // exact-unsplit (decode only): exact attention with DecodeSplits::never, one team per kv-head
};
constexpr unsigned kEvictAll = kEvictH2o | kEvictOthers;

// ---------------------------------------------------------------------------------------------------
// KVM and OVQ: kvmem::Memory.

/// OVQ as `kvmem-run ovq` runs it (tools/kvmem_run/ovq_command.hpp: chunk 128, a window of one chunk, no
/// sinks, no rotary channels, tau = beta = 1) with N = 256 centroids (plateau budget t N / (t + N)), the
/// row count of kvm-fixed256.
inline kvmem::MemoryConfig ovq_config(const Shape& s) {
  return {.head_dim = s.D, .value_dim = s.D, .query_heads = s.Hq(), .kv_heads = s.Hkv, .chunk = 128, .window_chunks = 1,
          .rope_dims = 0, .sinks = 0, .max_rows = 256};
}

/// Work model of kvmem::Memory<exec_t, Merge, Budget, score::Novelty, RowPolicy> for one sequence: mirrors
/// the host loop of Memory::prefill and Memory::decode (window_begin, plan_update, the lazy or eager fold,
/// the row cap) and counts per (sequence, kv-head)
///   readout: the state rows and window keys each query reads (attention_work);
///   update:  per fold, 2 D per (token, row) pair of the novelty score (when the fold ranks its tokens;
///            against the block's first token when seeding), 2 D per (token, candidate row) pair of the
///            routing argmax, 2 (D + Dv) per folded token; with H2O row eviction, 2 D per (query head,
///            query, state row read) of the row statistics (the readout's logit, recomputed).
template <class Merge, class Budget, class RowPolicy>
class MergingModel {
 public:
  MergingModel(const kvmem::MemoryConfig& cfg, const Budget& budget, const RowPolicy& row_policy)
      : cfg_(cfg), budget_(budget), cap_(row_policy.max_rows) {}

  /// Memory::prefill of T tokens into an empty memory.
  Work prefill(long T) {
    Work w;
    const long C = cfg_.chunk, L = cfg_.window();
    const long front = std::min(T, L);
    read(w, 0, front, 0, 0);
    cur_.tokens = front;
    if constexpr (Merge::first_chunk_verbatim)
      cur_.covered = cur_.rows = cur_.granted = std::min(T, C);
    else if (fold_due(T, front))
      fold(w);
    for (long s = L; s < T; s += C) {
      const long e = std::min(T, s + C);
      read(w, s, e, kvmem::state::window_begin(e, C, L), cur_.rows);
      cur_.tokens = e;
      if (fold_due(T, e)) fold(w);
    }
    return w;
  }

  /// The next Memory::decode step.
  Work step() {
    Work w;
    const long pos = cur_.tokens, n = pos + 1, nb = kvmem::state::window_begin(n, cfg_.chunk, cfg_.window());
    long rows = cur_.rows;  // an eager policy reads before its fold, a lazy one after
    if (Merge::first_chunk_verbatim && cur_.covered < std::min<long>(n, cfg_.chunk))
      cur_.rows = cur_.covered = cur_.granted = n;  // the token becomes a row
    else if (Merge::commit_eagerly ? fold_due(n, n) : fold_due(n, pos))
      fold(w);
    if (!Merge::commit_eagerly) rows = cur_.rows;
    cur_.tokens = n;
    read(w, pos, n, nb, nb > 0 ? rows : 0);
    return w;
  }
  /// State rows of the sequence after the steps modelled so far.
  [[nodiscard]] long rows() const { return cur_.rows; }

 private:
  /// Queries [first, last) each read `rows` state rows and the window keys [wb, u].
  void read(Work& w, long first, long last, long wb, long rows) {
    const double queries = double(last - first);
    const double window = (double(last - wb) * (last - wb + 1) - double(first - wb) * (first - wb + 1)) / 2;
    w += attention_work(cfg_.head_dim, cfg_.value_dim, cfg_.group(), queries * rows + window);
    if constexpr (RowPolicy::needs_probabilities) w.update += queries * rows * cfg_.group() * 2.0 * cfg_.head_dim;
  }
  /// Memory::fold_due: whether the next block folds once `seen` tokens of a sequence of `length` are read.
  [[nodiscard]] bool fold_due(long length, long seen) const {
    const long horizon = Merge::commit_eagerly ? seen + 1 : std::min(length, seen + cfg_.chunk);
    return kvmem::state::window_begin(horizon, cfg_.chunk, cfg_.window()) > cur_.covered;
  }
  /// The fold of the next block (kernels::update_state), then the row cap.
  void fold(Work& w) {
    const auto up = kvmem::state::plan_update(cfg_, budget_, cur_.granted, cur_.covered);  // as Memory::plan_block
    const long C = cfg_.chunk, m = cur_.rows;
    const int D = cfg_.head_dim, Dv = cfg_.value_dim;
    const bool seeding = !Merge::first_chunk_verbatim && m == 0;
    const long selected = seeding ? std::max(0L, up.append - 1) : up.append, folded = C - selected;
    if (selected > 0 && (selected < C || Merge::rows_in_score_order)) w.update += 2.0 * D * C * (seeding ? 1 : m);
    if (!seeding) {
      const long end = Merge::route_after_append ? m + selected : m;
      w.update += 2.0 * D * folded * (end - std::min<long>(cfg_.sinks, end));
    }
    w.update += 2.0 * (D + Dv) * folded;
    cur_.granted = up.rows_after();
    cur_.rows += up.append;
    if constexpr (RowPolicy::evicts) cur_.rows = std::min(cur_.rows, cap_);
    cur_.covered += C;
  }

  kvmem::MemoryConfig cfg_;
  Budget budget_;
  long cap_;
  kvmem::state::SequenceCursor cur_;
};

/// KVM or OVQ: kvmem::Memory<exec_t, Merge, Budget, score::Novelty, RowPolicy> for the shape's batch, with
/// unit layer weights.
template <class Merge, class Budget, class RowPolicy = kvmem::score::KeepRows,
          class M = kvmem::Memory<exec_t, Merge, Budget, kvmem::score::Novelty, RowPolicy>>
struct MergingAdapter : ContractAdapter<M, MergingAdapter<Merge, Budget, RowPolicy>> {
  MergingModel<Merge, Budget, RowPolicy> model;

  MergingAdapter(const Shape& s, const exec_t& exec, const kvmem::MemoryConfig& cfg, const Budget& budget,
                 const RowPolicy& row_policy = {})
      : ContractAdapter<M, MergingAdapter>(cfg, budget, unit_weights(s), s.B, row_policy, exec),
        model(cfg, budget, row_policy) {}

  static std::vector<std::string> readout_kernels() { return {"kvmem::readout"}; }
  static std::vector<std::string> update_kernels() {
    return {"kvmem::update", "kvmem::row_attn"};
  }
  void prepare(Inputs&) {}
  [[nodiscard]] typename M::inputs inputs_of(const Inputs& in) const { return {in.q, in.k, in.v, in.gate}; }
  [[nodiscard]] long rows() const { return this->mem.cursor(0).rows; }
};

/// Registration helper of the KVM family (kvm-fixed256, kvm-power-law, kvm-power-law-h2o256) and of OVQ:
/// calls reg(name, make) for each series in `series`, make(shape, exec) building its adapter.
template <class Reg>
void merging_family(Reg&& reg, unsigned series) {
  using namespace kvmem;
  using WinnerTakeAll = merge::WinnerTakeAll;
  if (series & kKvmFixed)
    reg("kvm-fixed256", [](const Shape& s, const exec_t& e) {
      return MergingAdapter<WinnerTakeAll, budget::Fixed>(s, e, memory_config(s), fixed256());
    });
  if (series & kKvmPowerLaw)
    reg("kvm-power-law", [](const Shape& s, const exec_t& e) {
      return MergingAdapter<WinnerTakeAll, budget::PowerLaw>(s, e, memory_config(s), power_law());
    });
  if (series & kKvmH2oRows)
    reg("kvm-power-law-h2o256", [](const Shape& s, const exec_t& e) {
      return MergingAdapter<WinnerTakeAll, budget::PowerLaw, score::RowAccumulatedAttention>(
          s, e, memory_config(s), power_law(), score::RowAccumulatedAttention{.max_rows = 256});
    });
  if (series & kOvq)
    reg("ovq-plateau256", [](const Shape& s, const exec_t& e) {
      return MergingAdapter<merge::KMeansCount, budget::Plateau>(s, e, ovq_config(s), budget::Plateau{256});
    });
}

// ---------------------------------------------------------------------------------------------------
// Trellis: kvmem::TrellisMemory.

/// Trellis with the spec's recommendations (TRELLIS.md §7: 64 slots, chunk 16, phi = SiLU, f = LN-SiLU,
/// as `kvmem-run trellis` runs it); the gate check is off (the benchmark's gates are in range by
/// construction, and engines that trust their gates turn it off). Heads = kv-heads: Trellis has no GQA.
inline kvmem::TrellisConfig trellis_config(const Shape& s) {
  return {.slots = 64, .head_dim = s.D, .value_dim = s.D, .heads = s.Hkv, .chunk = 16, .check_gates = false};
}

/// Work model of kvmem::TrellisMemory per (sequence, head), m slots: prefill in chunks of C tokens,
/// decode one token at a time (C = 1). A token at index r of its chunk counts
///   readout: 2 m (D + Dv) (S1 q and S2^T p against the state before the chunk) + (r + 1) 2 (D + Dv + 2 m)
///            (the in-chunk corrections of both passes: q.k_i and the m-vector u1_i, p.u2_i and v_i);
///   update:  4 m (D + Dv): its loss gradients at the stale states (M1 k, M2 v) and its part of the
///            end-of-chunk state update of M1 and M2.
/// A decode step reads the m rows of M1 and M2 (bytes).
class TrellisModel {
 public:
  explicit TrellisModel(const kvmem::TrellisConfig& cfg) : cfg_(cfg) {}
  Work prefill(long T) const {
    Work w;
    for (long first = 0; first < T; first += cfg_.chunk) w += chunk(std::min<long>(cfg_.chunk, T - first));
    return w;
  }
  Work step() const { return chunk(1); }
  [[nodiscard]] long rows() const { return cfg_.slots; }

 private:
  [[nodiscard]] Work chunk(long L) const {
    const double m = cfg_.slots, DDv = cfg_.head_dim + cfg_.value_dim;
    Work w;
    w.readout = L * 2.0 * m * DDv + double(L) * (L + 1) / 2 * 2.0 * (DDv + 2.0 * m);
    w.update = L * 4.0 * m * DDv;
    w.rows_read = L * m;
    return w;
  }
  kvmem::TrellisConfig cfg_;
};

/// Trellis: kvmem::TrellisMemory<exec_t> for the shape's batch, without LN affine.
struct TrellisAdapter : ContractAdapter<kvmem::TrellisMemory<exec_t>, TrellisAdapter> {
  TrellisModel model;

  TrellisAdapter(const Shape& s, const exec_t& exec, const kvmem::TrellisConfig& cfg)
      : ContractAdapter(cfg, s.B, exec), model(cfg) {}

  // One kernel ("kvmem::trellis") runs every chunk's gradients, readout and state update: no split.
  static std::vector<std::string> readout_kernels() { return {}; }
  static std::vector<std::string> update_kernels() { return {}; }
  void prepare(Inputs& in) const { in.add_trellis(mem.config().slots); }
  [[nodiscard]] kvmem::TrellisMemory<exec_t>::inputs inputs_of(const Inputs& in) const {
    return {in.q, in.k, in.v, in.alpha, in.beta1, in.gamma1, in.beta2, in.gamma2};
  }
  [[nodiscard]] long rows() const { return mem.config().slots; }
};

/// Registration helper of the Trellis family: trellis-m64 where G = 1.
template <class Reg>
void trellis_family(Reg&& reg, unsigned series, const Shape& s) {
  if ((series & kTrellis) && s.G == 1)
    reg("trellis-m64", [](const Shape& shape, const exec_t& e) { return TrellisAdapter(shape, e, trellis_config(shape)); });
}

// ---------------------------------------------------------------------------------------------------
// Fixed-budget eviction: kvmem::EvictionMemory.

/// Budget B = 4 sinks + a window of 64 + top-k 188 = 256 rows per (sequence, kv-head), the row count of
/// kvm-fixed256.
inline kvmem::EvictionConfig eviction_config(const Shape& s) {
  return {.head_dim = s.D, .value_dim = s.D, .query_heads = s.Hq(), .kv_heads = s.Hkv, .sinks = 4, .window = 64,
          .top_k = 188};
}

using MLstmScorer = kvmem::score::MLstm<space_t>;

/// A scorer with its parameters: the defaults, and for KVPOP's mLSTM random weights of the documented
/// shapes (uniform [-0.1, 0.1); biases and theta 0): the work does not depend on their values.
template <class Scorer>
Scorer make_scorer(const kvmem::EvictionConfig&) {
  return Scorer{};
}
template <>
inline MLstmScorer make_scorer<MLstmScorer>(const kvmem::EvictionConfig& cfg) {
  const long H = cfg.kv_heads, X = cfg.head_dim + cfg.value_dim, h = cfg.head_dim / 2;
  Kokkos::Random_XorShift64_Pool<exec_t> pool(2024);
  auto random = [&](auto view) {
    Kokkos::fill_random(view, pool, -0.1f, 0.1f);
    return view;
  };
  using v3 = Kokkos::View<float***, Kokkos::LayoutRight, space_t>;
  using v2 = Kokkos::View<float**, Kokkos::LayoutRight, space_t>;
  kvmem::score::MLstmWeights<space_t> w;
  w.w_q = random(v3("w_q", H, X, h)), w.w_k = random(v3("w_k", H, X, h)), w.w_v = random(v3("w_v", H, X, h));
  w.w_i = random(v2("w_i", H, X)), w.w_f = random(v2("w_f", H, X)), w.w_s = random(v2("w_s", H, h));
  w.b_i = view1("b_i", H), w.b_f = view1("b_f", H), w.b_s = view1("b_s", H), w.theta = view1("theta", H);
  Kokkos::fence();
  return MLstmScorer(w);
}

/// FLOPs of the eviction scorer at step q of one (sequence, kv-head) with `live` cached rows:
///   StreamingLLM 0; KNorm 2 D (the key's norm);
///   H2O, TOVA 2 per (query head, cached row): the probability they read (the readout's weight times the
///   normalizer's reciprocal) and its sum over the group (the logits are the readout's own);
///   KVPOP, with X = D + Dv and h = D / 2: 4 X h + 4 X + 3 D h to absorb the token (key and value
///   projections, gates, the decay and rank-1 update of C), and 2 X h + 2 D h to score the token leaving the
///   window (query projection, q^T C), once that token is past the sinks.
/// The search for the row to evict (comparisons of effective scores) is not counted.
template <class Scorer>
double scorer_flops(const kvmem::EvictionConfig& c, long q, long live) {
  const double D = c.head_dim, X = c.head_dim + c.value_dim, h = c.head_dim / 2;
  if constexpr (Scorer::needs_probabilities) {
    return c.group() * double(live) * 2.0;
  } else if constexpr (std::is_same_v<Scorer, MLstmScorer>) {
    const bool scores = q - c.window + 1 >= std::max(0, c.sinks);
    return 4 * X * h + 4 * X + 3 * D * h + (scores ? 2 * X * h + 2 * D * h : 0.0);
  } else if constexpr (std::is_same_v<Scorer, kvmem::score::KeyNorm>) {
    return 2 * D;
  } else {
    return 0.0;
  }
}

/// Work model of kvmem::EvictionMemory per (sequence, kv-head): step q (from 0) reads its live =
/// min(q + 1, B) cached rows (attention_work), plus the scorer's FLOPs (scorer_flops).
template <class Scorer>
class EvictionModel {
 public:
  explicit EvictionModel(const kvmem::EvictionConfig& cfg) : cfg_(cfg) {}
  Work prefill(long T) {
    Work w;
    for (long i = 0; i < T; ++i) w += step();
    return w;
  }
  Work step() {
    const long q = tokens_++, live = std::min(q + 1, cfg_.budget());
    Work w = attention_work(cfg_.head_dim, cfg_.value_dim, cfg_.group(), double(live));
    w.update = scorer_flops<Scorer>(cfg_, q, live);
    return w;
  }
  /// Cached rows after the steps modelled so far.
  [[nodiscard]] long rows() const { return std::min(tokens_, cfg_.budget()); }

 private:
  kvmem::EvictionConfig cfg_;
  long tokens_ = 0;
};

/// Fixed-budget eviction: kvmem::EvictionMemory<exec_t, Scorer> for the shape's batch.
template <class Scorer, class M = kvmem::EvictionMemory<exec_t, Scorer>>
struct EvictionAdapter : ContractAdapter<M, EvictionAdapter<Scorer>> {
  EvictionModel<Scorer> model;

  EvictionAdapter(const Shape& s, const exec_t& exec, const kvmem::EvictionConfig& cfg)
      : ContractAdapter<M, EvictionAdapter>(cfg, s.B, make_scorer<Scorer>(cfg), exec), model(cfg) {}

  // One kernel ("kvmem::evict") runs the whole per-token state machine: no readout/update split.
  static std::vector<std::string> readout_kernels() { return {}; }
  static std::vector<std::string> update_kernels() { return {}; }
  void prepare(Inputs&) {}
  [[nodiscard]] typename M::inputs inputs_of(const Inputs& in) const { return {in.q, in.k, in.v}; }
  [[nodiscard]] long rows() const {
    long live = 0;
    Kokkos::deep_copy(live, Kokkos::subview(this->mem.cache().live, 0, 0));
    return live;
  }
};

/// Registration helper of the eviction family: evict-<scorer>256 for H2O (kEvictH2o) and for StreamingLLM,
/// KNorm, TOVA and KVPOP (kEvictOthers).
template <class Reg>
void eviction_family(Reg&& reg, unsigned series) {
  namespace score = kvmem::score;
  auto add = [&]<class Scorer>(std::type_identity<Scorer>, unsigned bit) {
    if (series & bit)
      reg("evict-" + std::string(Scorer::name) + "256",
          [](const Shape& s, const exec_t& e) { return EvictionAdapter<Scorer>(s, e, eviction_config(s)); });
  };
  add(std::type_identity<score::None>{}, kEvictOthers);
  add(std::type_identity<score::KeyNorm>{}, kEvictOthers);
  add(std::type_identity<score::AccumulatedAttention>{}, kEvictH2o);
  add(std::type_identity<score::LastQueryAttention>{}, kEvictOthers);
  add(std::type_identity<MLstmScorer>{}, kEvictOthers);
}

// ---------------------------------------------------------------------------------------------------

/// Marks the benchmark failed when the work model's row count differs from the memory's after the run:
/// its FLOP and byte counts would not be those of the kernels that ran.
template <class Adapter>
void check_model(benchmark::State& st, const Adapter& mem) {
  if (mem.model.rows() != mem.rows()) {
    const std::string message = "work model out of step with the memory: " + std::to_string(mem.model.rows()) +
                                " rows modelled, " + std::to_string(mem.rows()) + " held";
    st.SkipWithError(message.c_str());  // a C string: Google Benchmark 1.7 (Debian 12) takes no std::string
  }
}

/// Calls reg(name, make) for every memory series in `series` at shape `s`, family by family.
template <class Reg>
void memory_series(Reg&& reg, unsigned series, const Shape& s) {
  merging_family(reg, series);
  trellis_family(reg, series, s);
  eviction_family(reg, series);
}

}  // namespace kvbench

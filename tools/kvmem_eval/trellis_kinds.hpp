#pragma once
/// \file trellis_kinds.hpp
/// The Trellis row of kvmem-eval (trellis-paper Sec. 3; spec TRELLIS.md): `trellis`, m slots per head sized
/// for each memory fraction, on the untrained inputs of trellis_inputs.hpp.

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <kvmem/trellis_memory.hpp>

#include "memory_kind.hpp"
#include "timed_prefill.hpp"
#include "trellis_inputs.hpp"

namespace kvmem::tools::eval {

/// Trellis as `kvmem-run trellis` runs it by default (spec TRELLIS.md §1, §7): phi = silu, f = ln-silu
/// without affine, chunk C = 16 (stale-gradient prefill), readout2_phi on, grad_scale 2; m slots, Hq heads.
inline TrellisConfig trellis_config(const Inputs& in, long slots) {
  TrellisConfig c;
  c.slots = static_cast<int>(slots);
  c.head_dim = static_cast<int>(in.D);
  c.value_dim = static_cast<int>(in.Dv);
  c.heads = static_cast<int>(in.Hq);
  c.chunk = 16;
  c.readout2_phi = true;
  return c;
}

/// Prefills a zero TrellisMemory<exec, T> with the inputs `t` (the first `prompt` tokens, the rest decode
/// steps, when `prompt` >= 0) and writes yt [B, Hq, T, Dv] of type T.
template <StorageType T, class Y>
RunStats prefill_trellis(const TrellisConfig& cfg, const TrellisInputs<T>& t, const Inputs& in, const Y& yt,
                         long prompt = -1) {
  using memory_t = TrellisMemory<exec, T>;
  memory_t mem(cfg, static_cast<int>(in.B));
  RunStats s = timed_prefill(mem, typename memory_t::inputs{t.q, t.k, t.v, t.alpha, t.forget, t.step, t.forget, t.step},
                             yt, in.lengths, prompt);
  s.rows.assign(in.B, cfg.slots);
  s.window.assign(in.B, 0);
  return s;
}

/// Makes the inputs in storage type T from the float32 tokens (not timed), prefills a zero
/// TrellisMemory<exec, T> with them and writes y [B, Hq, T, Dv] (widened to float32). Held memory is the
/// memory's held_bytes(): B x Hq x m x (D + Dv) float32 (the slots stay float32 in every storage type),
/// constant over the sequence.
template <StorageType T>
RunStats run_trellis(const TrellisConfig& cfg, const StoredInputs& stored, const OutView& y) {
  const Inputs& in = stored.f32;
  const auto t = make_trellis_inputs<T>(in, cfg.slots);
  return run_stored<T>(stored, y, [&](const InputsOf<T>&, const auto& yt) {
    return prefill_trellis<T>(cfg, t, in, yt, stored.prompt);
  });
}

/// trellis of storage type T, in table order.
template <StorageType T>
std::vector<MemoryKind> trellis_kinds() {
  std::vector<MemoryKind> kinds;
  kinds.push_back(
      {"trellis", "Trellis (untrained)",
       "m = round(f*T*Hkv/Hq) slots per query head (M1 [m, D] + M2 [m, Dv] hold f of the cache), C = 16, phi = silu, "
       "f = ln-silu; unit q, k, v, alpha = R khat (fixed random +-1 R), every gate sigmoid(0) = 1/2",
       false, [](const Inputs& in, const SizingOptions&, double f, const std::string&) {
         const double slots = f * static_cast<double>(longest(in)) * static_cast<double>(in.Hkv) /
                              static_cast<double>(in.Hq);
         const auto cfg = trellis_config(in, std::max(1L, static_cast<long>(std::llround(slots))));
         const nlohmann::json inputs = {{"q_k_v", "x / max(||x||, 1e-12) per head and token"},
                                        {"alpha", "R khat, R [m, D] with entries +-1 from splitmix64"},
                                        {"alpha_seed", trellis_alpha_seed},
                                        {"beta1_beta2", trellis_untrained_gate},
                                        {"gamma1_gamma2", trellis_untrained_gate}};
         return Plan{{{"slots", cfg.slots}, {"chunk", cfg.chunk}, {"phi", std::string(merge::name_of(cfg.phi))},
                      {"f", std::string(merge::name_of(cfg.f))}, {"readout2_phi", cfg.readout2_phi},
                      {"grad_scale", cfg.grad_scale}, {"inputs", inputs}},
                     fmt("m=%d C=%d", cfg.slots, cfg.chunk),
                     [cfg](const StoredInputs& i, const OutView& y) { return run_trellis<T>(cfg, i, y); }};
       }});
  return kinds;
}

}  // namespace kvmem::tools::eval

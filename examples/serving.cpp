/// \file serving.cpp
/// Continuous batching in C++: requests of random prompt and output lengths arrive (Poisson) and leave, up
/// to --slots at a time, each layer served by one kvmem memory whose batch is the slots, against a full KV
/// cache in the same process. Prints throughput, memory held and latency percentiles with a progress bar,
/// and writes the runs as JSON that examples/python/serving.py plots (--replot). Every layer is driven
/// through the one memory contract (kvmem::AttentionMemory), whatever its family.
///
///   kvmem_example_serving [--memory h2o|kvm] [--budget 128] [--requests 64] [--slots 32] [--rate 50]
///                         [--layers 8] [--prefill-chunk 0] [--json serving-cpp.json]
///
/// The engine loop (an engine's scheduler reduced to its bones): each step admits arrived requests into free
/// slots and prefills them in one call per layer (prefill with lengths: the other slots keep their state;
/// with --prefill-chunk N a prompt comes in chunks of N tokens, one per step, between the other slots'
/// decode steps), then runs one decode step of every slot past its prompt (decode with an active set),
/// and frees the slot of a finished request (reset_sequence). There is no model: the queries, keys and
/// values of token t of request r on layer l are seeded normal numbers (Hq = 8 query heads, Hkv = 2
/// kv-heads, head_dim 64), so both runs read the same tokens and the time is the memories' own.
/// The full cache is an eviction memory whose window holds every token (exact attention over all of them);
/// its bytes are counted as a paged cache holds them: the live tokens' keys and values. The kvmem memory:
/// h2o, eviction with 4 sinks, a window of budget / 4 and the rest top-scored; kvm, KVM with a fixed budget
/// of `budget` state rows after a window of two chunks of 16 (merge gate z = 0, neutral LayerNorm).

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <kvmem/kvmem.hpp>

namespace {

using exec = Kokkos::DefaultHostExecutionSpace;
using space = exec::memory_space;
using view4 = Kokkos::View<float****, Kokkos::LayoutRight, space>;
using view3 = Kokkos::View<float***, Kokkos::LayoutRight, space>;
constexpr int Hq = 8, Hkv = 2, D = 64;

struct Options {
  std::string memory = "h2o", json = "serving-cpp.json";
  long budget = 128, requests = 64, slots = 32, layers = 8, prefill_chunk = 0, min_prompt = 64, max_prompt = 1024,
       min_output = 16, max_output = 128;
  double rate = 50.0;
  unsigned seed = 1;
};

struct Request {
  long id, prompt, output;
  double arrival;
};

/// Fills x[slot, h, t0 + j, :] for j < n with the seeded token values of request r, layer l, positions
/// [first, first + n) (`which`: 0 query, 1 key, 2 value).
void fill(const view4& x, long slot, long t0, long n, const Request& r, long l, long first, int which) {
  for (long j = 0; j < n; ++j) {
    std::mt19937 rng(static_cast<unsigned>(((r.id * 131 + l) * 4099 + first + j) * 3 + which));
    std::normal_distribution<float> normal;
    for (long h = 0; h < static_cast<long>(x.extent(1)); ++h)
      for (long d = 0; d < D; ++d) x(slot, h, t0 + j, d) = normal(rng);
  }
}

/// One layer's memory behind the calls the loop makes.
struct Layer {
  std::function<void(const view4&, const view4&, const view4&, const view4&, std::span<const long>)> prefill;
  std::function<void(const view4&, const view4&, const view4&, const view4&, std::span<const unsigned char>)> decode;
  std::function<void(long)> reset_sequence;
  std::function<long()> held_bytes;
};

/// Any memory through the one contract (kvmem::AttentionMemory); `inputs`(q, k, v) makes its M::inputs.
template <kvmem::AttentionMemory M, class Inputs>
Layer layer_of(std::shared_ptr<M> m, Inputs inputs) {
  return {[m, inputs](const view4& q, const view4& k, const view4& v, const view4& y, std::span<const long> len) {
            m->prefill(inputs(q, k, v), y, len);
          },
          [m, inputs](const view4& q, const view4& k, const view4& v, const view4& y, std::span<const unsigned char> on) {
            m->decode(inputs(q, k, v), y, on);
          },
          [m](long b) { m->reset_sequence(b); }, [m] { return m->held_bytes(); }};
}

template <class Scorer>
Layer eviction_layer(const kvmem::EvictionConfig& cfg, long slots) {
  using M = kvmem::EvictionMemory<exec, Scorer>;
  return layer_of(std::make_shared<M>(cfg, static_cast<int>(slots)),
                  [](const view4& q, const view4& k, const view4& v) { return typename M::inputs{q, k, v}; });
}

Layer kvm_layer(long budget, long slots) {
  kvmem::MemoryConfig cfg;
  cfg.head_dim = cfg.value_dim = D;
  cfg.query_heads = Hq;
  cfg.kv_heads = Hkv;
  cfg.chunk = 16;
  cfg.window_chunks = 2;
  cfg.sinks = 1;
  cfg.rope_dims = 0;
  cfg.max_rows = budget;
  Kokkos::View<float*, space> ones("ones", D), zeros("zeros", D), taus("taus", Hq);
  Kokkos::deep_copy(ones, 1.0f);
  Kokkos::deep_copy(taus, 1.0f);
  using M = kvmem::KvmMemory<exec, kvmem::budget::Fixed>;
  auto m = std::make_shared<M>(cfg, kvmem::budget::Fixed{budget}, kvmem::LayerWeights<space>{ones, zeros, taus, taus},
                               static_cast<int>(slots));
  // Merge gate z = 0: an empty gate view.
  return layer_of(m, [](const view4& q, const view4& k, const view4& v) { return typename M::inputs{q, k, v, {}}; });
}

struct Done {
  long id, prompt, output;
  double ttft, tpot, latency;
};
struct Run {
  std::string label;
  std::vector<Done> done;
  std::vector<std::pair<double, long>> trace;  // (time s, bytes held)
  double wall = 0;
  long generated = 0;
};

/// The engine loop over `requests` with the layers `layers`; `paged_bytes` counts a full cache's bytes from
/// the live tokens instead of the layers' held_bytes().
Run serve(const std::string& label, std::vector<Layer>& layers, const std::vector<Request>& requests, const Options& o,
          bool paged_bytes) {
  struct Slot {
    long req = -1, seen = 0, generated = 0;
    double first = 0, last = 0;
  };
  std::vector<Slot> slots(o.slots);
  std::deque<Request> waiting(requests.begin(), requests.end());
  Run run{label, {}, {}, 0, 0};
  const auto start = std::chrono::steady_clock::now();
  double skipped = 0;
  auto now = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() + skipped; };
  long total = 0;
  for (const auto& r : requests) total += r.output;
  auto progress = [&] {
    const int width = 40, filled = static_cast<int>(width * run.generated / std::max(total, 1L));
    std::fprintf(stderr, "\r%-24s [%s%s] %ld/%ld tokens", label.c_str(), std::string(filled, '#').c_str(),
                 std::string(width - filled, '.').c_str(), run.generated, total);
  };
  auto busy = [&] { return std::any_of(slots.begin(), slots.end(), [](const Slot& s) { return s.req >= 0; }); };
  while (!waiting.empty() || busy()) {
    if (!busy() && waiting.front().arrival > now()) skipped += waiting.front().arrival - now();
    for (auto& s : slots)
      if (s.req < 0 && !waiting.empty() && waiting.front().arrival <= now()) {
        s = Slot{waiting.front().id, 0, 0, 0, 0};
        waiting.pop_front();
      }
    // Prefill the slots whose prompt is not in yet (or its next chunk); the others keep their state.
    std::vector<long> piece(o.slots, 0);
    for (long b = 0; b < o.slots; ++b) {
      const auto& s = slots[b];
      if (s.req < 0 || s.seen >= requests[s.req].prompt) continue;
      const long left = requests[s.req].prompt - s.seen;
      piece[b] = o.prefill_chunk > 0 ? std::min(left, o.prefill_chunk) : left;
    }
    const long T = *std::max_element(piece.begin(), piece.end());
    if (T > 0) {
      view4 q("q", o.slots, Hq, T, D), k("k", o.slots, Hkv, T, D), v("v", o.slots, Hkv, T, D), y("y", o.slots, Hq, T, D);
      for (long l = 0; l < o.layers; ++l) {
        for (long b = 0; b < o.slots; ++b)
          if (piece[b] > 0) {
            const auto& r = requests[slots[b].req];
            fill(q, b, 0, piece[b], r, l, slots[b].seen, 0), fill(k, b, 0, piece[b], r, l, slots[b].seen, 1);
            fill(v, b, 0, piece[b], r, l, slots[b].seen, 2);
          }
        layers[l].prefill(q, k, v, y, piece);
      }
      for (long b = 0; b < o.slots; ++b) {
        auto& s = slots[b];
        if (piece[b] == 0) continue;
        s.seen += piece[b];
        if (s.seen == requests[s.req].prompt) s.generated = 1, s.first = s.last = now(), ++run.generated;  // its first token
      }
    }
    // One decode step of every slot past its prompt that still owes tokens.
    std::vector<unsigned char> active(o.slots, 0);
    for (long b = 0; b < o.slots; ++b) {
      const auto& s = slots[b];
      active[b] = s.req >= 0 && s.seen == requests[s.req].prompt && s.generated > 0 && s.generated < requests[s.req].output;
    }
    if (std::any_of(active.begin(), active.end(), [](unsigned char a) { return a != 0; })) {
      view4 q("q", o.slots, Hq, 1, D), k("k", o.slots, Hkv, 1, D), v("v", o.slots, Hkv, 1, D), y("y", o.slots, Hq, 1, D);
      for (long l = 0; l < o.layers; ++l) {
        for (long b = 0; b < o.slots; ++b)
          if (active[b]) {
            const auto& r = requests[slots[b].req];
            const long pos = r.prompt + slots[b].generated - 1;
            fill(q, b, 0, 1, r, l, pos, 0), fill(k, b, 0, 1, r, l, pos, 1), fill(v, b, 0, 1, r, l, pos, 2);
          }
        layers[l].decode(q, k, v, y, active);
      }
      for (long b = 0; b < o.slots; ++b)
        if (active[b]) ++slots[b].generated, slots[b].last = now(), ++run.generated;
    }
    long held = 0;
    for (long b = 0; b < o.slots && paged_bytes; ++b)
      if (slots[b].req >= 0) held += (slots[b].seen + std::max(0L, slots[b].generated - 1)) * o.layers * Hkv * 2 * D * 4;
    for (long l = 0; l < o.layers && !paged_bytes; ++l) held += layers[l].held_bytes();
    run.trace.emplace_back(now(), held);
    for (long b = 0; b < o.slots; ++b) {  // requests with all their tokens leave; their slots are freed
      auto& s = slots[b];
      if (s.req < 0 || s.generated < requests[s.req].output) continue;
      const auto& r = requests[s.req];
      run.done.push_back({r.id, r.prompt, r.output, s.first - r.arrival,
                          r.output > 1 ? (s.last - s.first) / static_cast<double>(r.output - 1) : 0.0,
                          s.last - r.arrival});
      for (auto& layer : layers) layer.reset_sequence(b);
      s = Slot{};
    }
    progress();
  }
  std::fprintf(stderr, "\n");
  run.wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return run;
}

double percentile(std::vector<double> x, double p) {
  std::sort(x.begin(), x.end());
  const long i = std::clamp(static_cast<long>(std::ceil(p / 100.0 * x.size())) - 1, 0L, static_cast<long>(x.size()) - 1);
  return x[i];
}

long flag(int argc, char** argv, int& i) {
  if (i + 1 >= argc) {
    std::fprintf(stderr, "%s needs a value\n", argv[i]);
    std::exit(2);
  }
  return std::atol(argv[++i]);
}

}  // namespace

int main(int argc, char** argv) {
  Kokkos::ScopeGuard guard(argc, argv);
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--memory" && i + 1 < argc) o.memory = argv[++i];
    else if (a == "--json" && i + 1 < argc) o.json = argv[++i];
    else if (a == "--budget") o.budget = flag(argc, argv, i);
    else if (a == "--requests") o.requests = flag(argc, argv, i);
    else if (a == "--slots") o.slots = flag(argc, argv, i);
    else if (a == "--layers") o.layers = flag(argc, argv, i);
    else if (a == "--prefill-chunk") o.prefill_chunk = flag(argc, argv, i);
    else if (a == "--rate" && i + 1 < argc) o.rate = std::atof(argv[++i]);
    else {
      std::fprintf(stderr, "unknown argument '%s' (see the comment at the top of examples/serving.cpp)\n", a.c_str());
      return 2;
    }
  }
  if ((o.memory != "h2o" && o.memory != "kvm") || o.budget < 16 || o.requests < 1 || o.slots < 1 || o.layers < 1 ||
      o.prefill_chunk < 0 || !(o.rate > 0)) {
    std::fprintf(stderr, "--memory must be h2o or kvm, --budget >= 16, --requests, --slots, --layers >= 1, "
                         "--prefill-chunk >= 0, --rate > 0\n");
    return 2;
  }
  std::mt19937 rng(o.seed);
  std::vector<Request> requests;
  double clock = 0;
  for (long i = 0; i < o.requests; ++i) {
    clock += std::exponential_distribution<double>(o.rate)(rng);
    const long prompt = std::uniform_int_distribution<long>(o.min_prompt, o.max_prompt)(rng);
    requests.push_back({i, prompt, std::uniform_int_distribution<long>(o.min_output, o.max_output)(rng), clock});
  }
  std::printf("workload: %ld requests, Poisson arrivals at %.0f/s, prompts %ld-%ld tokens, outputs %ld-%ld tokens, "
              "up to %ld at a time; %ld layers of Hq = %d, Hkv = %d, head_dim %d; backend %s (%d threads)\n",
              o.requests, o.rate, o.min_prompt, o.max_prompt, o.min_output, o.max_output, o.slots, o.layers, Hq, Hkv, D,
              exec::name(), exec().concurrency());
  std::fflush(stdout);

  std::vector<Run> runs;
  {  // the full KV cache: a window that holds every token
    kvmem::EvictionConfig full{.head_dim = D, .value_dim = D, .query_heads = Hq, .kv_heads = Hkv, .sinks = 0,
                               .window = static_cast<int>(o.max_prompt + o.max_output), .top_k = 0};
    std::vector<Layer> layers;
    for (long l = 0; l < o.layers; ++l) layers.push_back(eviction_layer<kvmem::score::None>(full, o.slots));
    runs.push_back(serve("full KV cache", layers, requests, o, /*paged_bytes=*/true));
  }
  {
    std::vector<Layer> layers;
    const int window = static_cast<int>(o.budget / 4);
    const kvmem::EvictionConfig h2o{.head_dim = D, .value_dim = D, .query_heads = Hq, .kv_heads = Hkv, .sinks = 4,
                                    .window = window, .top_k = static_cast<int>(o.budget) - 4 - window};
    for (long l = 0; l < o.layers; ++l)
      layers.push_back(o.memory == "h2o" ? eviction_layer<kvmem::score::AccumulatedAttention>(h2o, o.slots)
                                         : kvm_layer(o.budget, o.slots));
    runs.push_back(serve("kvmem " + o.memory + " " + std::to_string(o.budget), layers, requests, o, false));
  }

  std::printf("\n%-22s %8s %11s %22s %23s %20s\n", "cache", "tok/s", "peak held", "TTFT p50/p90/p99 (ms)",
              "TPOT p50/p90/p99 (ms)", "latency p50/p99 (s)");
  std::ofstream json(o.json);
  json << "{\"runs\": [";
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const auto& r = runs[i];
    std::vector<double> ttft, tpot, latency;
    for (const auto& d : r.done) ttft.push_back(d.ttft), tpot.push_back(d.tpot), latency.push_back(d.latency);
    long peak = 0;
    for (const auto& [t, b] : r.trace) peak = std::max(peak, b);
    std::printf("%-22s %8.0f %7.1f MiB %6.0f %6.0f %6.0f   %6.2f %6.2f %6.2f   %8.2f %8.2f\n", r.label.c_str(),
                r.generated / r.wall, peak / 1048576.0, 1e3 * percentile(ttft, 50), 1e3 * percentile(ttft, 90),
                1e3 * percentile(ttft, 99), 1e3 * percentile(tpot, 50), 1e3 * percentile(tpot, 90),
                1e3 * percentile(tpot, 99), percentile(latency, 50), percentile(latency, 99));
    json << (i ? ", " : "") << "{\"label\": \"" << r.label << "\", \"wall_s\": " << r.wall
         << ", \"generated\": " << r.generated << ", \"requests\": [";
    for (std::size_t j = 0; j < r.done.size(); ++j) {
      const auto& d = r.done[j];
      json << (j ? ", " : "") << "{\"id\": " << d.id << ", \"prompt\": " << d.prompt << ", \"output\": " << d.output
           << ", \"ttft\": " << d.ttft << ", \"tpot\": " << d.tpot << ", \"latency\": " << d.latency << "}";
    }
    json << "], \"trace\": [";
    for (std::size_t j = 0; j < r.trace.size(); ++j)
      json << (j ? ", " : "") << "{\"time\": " << r.trace[j].first << ", \"held_bytes\": " << r.trace[j].second << "}";
    json << "]}";
  }
  json << "]}\n";
  std::printf("runs: %s (plot: python examples/python/serving.py --replot %s --plot serving-cpp.png)\n", o.json.c_str(),
              o.json.c_str());
  return 0;
}

/// \file main.cpp
/// kvmem-eval: how close each memory's attention output stays to exact causal attention on one captured
/// layer, at each memory fraction of the full KV cache. Table on stdout, optional JSON and PNG plot.
///
///   kvmem-eval --input layer.safetensors [--fractions 1/4,1/8,1/16,1/32] [--memories kvm-fixed,ovq,...]
///              [--dtype f32|bf16|f16] [--json out.json] [--plot out.png] [--buckets 8] [--label NAME]
///              [--window-share 0.25] [--window-chunks 1] [--sinks 1] [--rope-dims 0] [--no-progress]
///              [--weights FILE ...] [--layer L] [--prompt P] [--list-memories]
///
/// --prompt P reads the first P tokens of each sequence in one prefill (a prompt) and the others as decode
/// steps, one token each (an answer), in every memory, and compares the outputs at the decoded positions only
/// (t >= P): what a memory that compresses at the end of a prompt or per chunk (the rows snapkv-end, h2o-end,
/// tova-end, knorm-end, streaming-end, snapkv-end-merge, snapkv-chunk, h2o-chunk, which run only with it and
/// only when --memories names them) gives after the prompt. The streaming memories mean the same in a prefill
/// and token by token, so their rows only lose the prompt's positions.
///
/// The memories run in the input's token dtype (F32, BF16 or F16; F64 runs as F32) or the one --dtype
/// names; the reference is exact causal attention in float32 over the same tokens widened to float32, so a
/// bf16 run's error includes what rounding the tokens to bf16 costs when the input was float32.
///
/// --weights (repeatable) gives trained parameters (kvmem weights files of kvm or ovq from
/// tools/distill/distill.py; tools/kvmem_run/trained_inputs.hpp) to the row its metadata `memory_id` names
/// (kvm-fixed, kvm-sqrt or ovq), at every fraction: KVM's gate from the input's attention input x, its
/// LayerNorm and temperatures; OVQ's beta. Exact attention and the other rows keep the input's own
/// parameters; the row says "(trained at F)", F the fraction the weights were trained for.
///
/// Exit status: 0 on success, 2 for bad options or inputs (the message names the parameter and value),
/// 1 for any other failure (a plot that could not be drawn included).

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../kvmem_run/trained_inputs.hpp"
#include "memories.hpp"
#include "metrics.hpp"

extern char** environ;

#ifndef KVMEM_EVAL_PLOT_SCRIPT
#define KVMEM_EVAL_PLOT_SCRIPT "plot.py"
#endif

namespace kvmem::tools::eval {

struct Options {
  std::string input, json, plot, label, plot_script;
  std::string dtype;  ///< --dtype: "", f32, bf16 or f16 (TokenDtype::of)
  std::vector<std::string> fractions{"1/4", "1/8", "1/16", "1/32"};
  std::vector<std::string> memories = memory_ids();  // every memory, in table order
  int buckets = 8;
  bool no_progress = false, list = false;
  SizingOptions sizing;
  std::vector<std::string> weights;  ///< --weights: kvmem weights files, at most one per memory
  long layer = -1;                   ///< --layer: their layer (-1: the input's metadata 'layer')
};

/// The inputs of `file` for a run in `dtype`: float32 tokens (the reference's, any float dtype widened) and,
/// for a 16-bit run, the tokens in that type.
inline StoredInputs load_stored(const io::SafetensorsFile& file, const TokenDtype& dtype) {
  StoredInputs stored;
  stored.f32 = Inputs::load(file, TokenDtype::of(file, "f32"));
  if (dtype.name == "BF16") stored.bf16 = InputsOf<bfloat16>::load(file, dtype);
  if (dtype.name == "F16") stored.f16 = InputsOf<float16>::load(file, dtype);
  return stored;
}

/// "1/8", "0.125" or "12.5%" -> 0.125. Throws kvmem::invalid_argument naming --fractions.
inline double parse_fraction(const std::string& s) {
  auto number = [&](const std::string& x) {
    std::size_t used = 0;
    double v = NAN;
    try {
      v = std::stod(x, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    require(used == x.size() && !x.empty() && std::isfinite(v), "--fractions", s,
            "not a fraction (write 1/8, 0.125 or 12.5%)");
    return v;
  };
  double v;
  if (const auto slash = s.find('/'); slash != std::string::npos) {
    const double den = number(s.substr(slash + 1));
    require(den != 0, "--fractions", s, "division by zero");
    v = number(s.substr(0, slash)) / den;
  } else if (!s.empty() && s.back() == '%') {
    v = number(s.substr(0, s.size() - 1)) / 100.0;
  } else {
    v = number(s);
  }
  require(v > 0 && std::isfinite(v), "--fractions", s, "must be > 0 (a share of the full KV cache)");
  return v;
}

/// A progress bar on stderr, drawn only when stderr is a terminal.
class Progress {
 public:
  Progress(int total, bool enabled) : total_(total), on_(enabled && isatty(STDERR_FILENO)) {}
  void step(const std::string& what) {
    if (!on_) return;
    const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const int width = 30, filled = total_ ? done_ * width / total_ : width;
    std::string bar(filled, '#');
    bar.resize(width, '.');
    std::string eta = done_ > 0 ? fmt("  eta %.0f s", el / done_ * (total_ - done_)) : "";
    std::fprintf(stderr, "\r\033[K[%s] %d/%d  %s%s", bar.c_str(), done_, total_, what.c_str(), eta.c_str());
    std::fflush(stderr);
  }
  void advance() { ++done_; }
  void finish() {
    if (!on_) return;
    std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
  }

 private:
  int total_, done_ = 0;
  bool on_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

/// Every value of q, k, v and gate must be finite: the ground truth is meaningless otherwise.
template <class V>
void require_finite(const V& view, const char* name) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), view);
  const float* p = h.data();
  for (std::size_t i = 0; i < h.span(); ++i)
    if (!std::isfinite(p[i])) {
      std::string at;
      std::size_t rest = i;
      std::vector<std::size_t> idx(V::rank());
      for (int r = static_cast<int>(V::rank()) - 1; r >= 0; --r) {
        idx[r] = rest % h.extent(r);
        rest /= h.extent(r);
      }
      for (std::size_t r = 0; r < idx.size(); ++r) at += (r ? ", " : "") + std::to_string(idx[r]);
      require(false, std::string("tensor '") + name + "' value at [" + at + "]", p[i], "must be finite");
    }
}

inline std::string mib(long bytes) { return fmt("%.3f MiB", bytes / 1048576.0); }

/// memory_kinds<T>() for the storage type of the run's dtype `d` (TokenDtype::name: F32, BF16 or F16).
inline std::vector<MemoryKind> memory_kinds_of(const TokenDtype& d) {
  if (d.name == "BF16") return memory_kinds<bfloat16>();
  if (d.name == "F16") return memory_kinds<float16>();
  return memory_kinds<float>();
}

/// Bytes of one token element in the run's dtype `d`.
inline long element_bytes(const TokenDtype& d) { return d.name == "F32" ? 4 : 2; }

/// Runs the evaluation the options describe; returns the report. Throws kvmem::invalid_argument for bad input.
inline nlohmann::json evaluate(const Options& o) {
  // Options first (cheap), then the input file.
  require(o.buckets >= 1 && o.buckets <= 1000, "--buckets", o.buckets, "must be in [1, 1000]");
  require(o.sizing.window_share > 0 && o.sizing.window_share <= 1, "--window-share", o.sizing.window_share,
          "must be in (0, 1]");
  require(o.sizing.window_chunks >= 1, "--window-chunks", o.sizing.window_chunks, "must be >= 1");
  require(o.sizing.sinks >= 0, "--sinks", o.sizing.sinks, "must be >= 0");
  require(!o.fractions.empty(), "--fractions", "(none)", "give at least one fraction");
  require(!o.memories.empty(), "--memories", "(none)", "give at least one memory");
  for (const auto& [flag, path] : {std::pair{"--json", o.json}, std::pair{"--plot", o.plot}}) {
    if (path.empty()) continue;
    const auto dir = std::filesystem::path(path).parent_path();
    require(dir.empty() || std::filesystem::is_directory(dir), flag, path,
            "its directory " + dir.string() + " does not exist");
  }
  std::vector<double> fractions;
  for (const auto& f : o.fractions) fractions.push_back(parse_fraction(f));
  const auto known_ids = memory_ids(/*after_prompt=*/true), streaming_ids = memory_ids();
  require(o.sizing.prompt == -1 || o.sizing.prompt >= 1, "--prompt", o.sizing.prompt,
          "must be >= 1 (tokens read in one prefill before the decode steps)");
  for (const auto& id : o.memories) {
    std::string known;
    for (const auto& k : known_ids) known += (known.empty() ? "" : ", ") + k;
    require(std::find(known_ids.begin(), known_ids.end(), id) != known_ids.end(), "--memories", id,
            "unknown memory (known: " + known + ")");
    require(o.sizing.prompt >= 1 || std::find(streaming_ids.begin(), streaming_ids.end(), id) != streaming_ids.end(),
            "--memories", id,
            "compresses at the end of a prompt or per chunk: give --prompt P (over one prefill its output is exact "
            "attention)");
  }

  const auto file = io::SafetensorsFile::read(o.input);
  const auto dtype = TokenDtype::of(file, o.dtype);  // the memories' storage type
  StoredInputs stored = load_stored(file, dtype);
  stored.prompt = o.sizing.prompt;
  const Inputs& in = stored.f32;
  // Trained weights: for the row each file names (metadata memory_id), the inputs with its trained
  // parameters (the same token views; gate and layer weights replaced).
  std::map<std::string, StoredInputs> trained;              // row id -> its inputs
  std::map<std::string, nlohmann::json> trained_files;      // row id -> the file and what it was trained for
  require_weights_for_layer({o.weights.empty() ? "" : o.weights.front(), o.layer});
  for (const auto& path : o.weights) {
    auto raw = io::SafetensorsFile::read(path);
    const auto meta = [&](const char* key) {
      return raw.metadata.count(key) ? raw.metadata.at(key) : std::string("(none)");
    };
    require(meta("format") == io::memory_weights_format, "--weights " + path + " metadata format", meta("format"),
            std::string("must be ") + io::memory_weights_format + " (a kvmem weights file from tools/distill/distill.py)");
    const auto m = meta("memory"), id = meta("memory_id");
    require(m == "kvm" || m == "ovq", "--weights " + path + " metadata memory", m,
            "kvmem-eval applies the weights of kvm or ovq");
    require(id == "kvm-fixed" || id == "kvm-sqrt" || id == "ovq", "--weights " + path + " metadata memory_id", id,
            "must name the row the weights were trained for: kvm-fixed, kvm-sqrt or ovq");
    require(id.rfind(m, 0) == 0, "--weights " + path + " metadata memory_id", id, "is not a row of memory " + m);
    require(std::find(o.memories.begin(), o.memories.end(), id) != o.memories.end(), "--weights", path,
            "trained for the row " + id + ", which --memories does not select");
    if (trained.count(id))
      require(false, "--weights", path,
              "a second weights file for the row " + id + " (the first: " + trained_files.at(id)["file"].get<std::string>() + ")");
    const auto fraction = meta("fraction");
    const auto w = io::MemoryWeightsFile::from(std::move(raw), path, m);
    // The input's own parameters (gate, LayerNorm, temperatures), with the trained ones in their place.
    io::SafetensorsFile params;
    for (const char* name : {"gate", "ln_weight", "ln_bias", "tau_state", "tau_bswa"})
      if (file.has(name)) params.tensors[name] = file.at(name);
    auto trained_tensors = trained_parameters(file, w, weights_layer(file, o.layer));
    for (auto& [name, tensor] : trained_tensors.tensors) params.tensors[name] = std::move(tensor);
    StoredInputs t = stored;  // views are handles: the tokens are shared, not copied
    t.f32.load_parameters(params, TokenDtype::of(file, "f32"));
    if (dtype.name == "BF16") t.bf16.load_parameters(params, dtype);
    if (dtype.name == "F16") t.f16.load_parameters(params, dtype);
    trained[id] = t;
    trained_files[id] = {{"file", path}, {"fraction", fraction}, {"setup", w.metadata().count("setup") ? w.metadata().at("setup") : ""}};
  }
  const auto all = memory_kinds_of(dtype);
  std::vector<MemoryKind> kinds;
  for (const auto& id : o.memories) {
    kinds.push_back(*std::find_if(all.begin(), all.end(), [&](const MemoryKind& k) { return k.id == id; }));
    if (trained.count(id)) kinds.back().label += " (trained at " + trained_files[id]["fraction"].get<std::string>() + ")";
  }
  require(o.sizing.rope_dims >= 0 && o.sizing.rope_dims <= in.D, "--rope-dims", o.sizing.rope_dims,
          "must be in [0, head_dim = " + std::to_string(in.D) + "]");
  require_finite(in.q, "q");
  require_finite(in.k, "k");
  require_finite(in.v, "v");
  require_finite(in.gate, "gate");
  long tokens = 0;
  for (long n : in.lengths) tokens += n;
  require(tokens > 0, "tensor 'lengths' (or T)", tokens, "no tokens to evaluate");
  const long T = longest(in);
  require(o.sizing.prompt < T, "--prompt", o.sizing.prompt,
          "must be below the longest sequence's " + std::to_string(T) + " tokens (decode steps follow the prompt)");
  const long from = std::max(0L, o.sizing.prompt);  // the first position compared

  // Plans first, so a fraction no memory can be sized for fails before any work.
  struct Job {
    const MemoryKind* kind;
    std::string fraction_label;
    double fraction;
    Plan plan;
  };
  std::vector<Job> jobs;
  for (const auto& k : kinds) {
    if (k.own_size) {
      jobs.push_back({&k, "own", NAN, k.plan(in, o.sizing, NAN, "own")});
      continue;
    }
    for (std::size_t i = 0; i < fractions.size(); ++i)
      jobs.push_back({&k, o.fractions[i], fractions[i], k.plan(in, o.sizing, fractions[i], o.fractions[i])});
  }

  Progress progress(static_cast<int>(jobs.size()) + 1, !o.no_progress);
  progress.step("exact causal attention");
  const auto buckets = position_buckets(T, o.buckets);
  OutView y_exact("y_exact", in.B, in.Hq, in.T, in.Dv);
  Kokkos::fence();
  auto t0 = std::chrono::steady_clock::now();
  kernels::exact_causal_attention(exec(), in.q, in.k, in.v, y_exact, in.weights.tau_window.data());
  Kokkos::fence();
  const double exact_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  progress.advance();
  const auto ref = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y_exact);

  const long full = tokens * in.Hkv * (in.D + in.Dv) * element_bytes(dtype);
  nlohmann::json report;
  report["tool"] = "kvmem-eval";
  report["input"] = o.input;
  report["label"] = o.label;
  report["input_metadata"] = file.metadata;
  report["dtype"] = dtype.flag();           // the memories' storage type
  report["input_dtype"] = dtype.q_dtype;    // tensor q's dtype in the file
  report["shape"] = {{"B", in.B}, {"Hq", in.Hq}, {"Hkv", in.Hkv}, {"T", in.T}, {"D", in.D}, {"Dv", in.Dv},
                     {"tokens", tokens}, {"lengths", in.lengths}};
  report["backend"] = {{"name", exec().name()}, {"concurrency", exec().concurrency()}};
  report["full_kv_bytes"] = full;
  report["sizing"] = {{"window_share", o.sizing.window_share}, {"window_chunks", o.sizing.window_chunks},
                      {"sinks", o.sizing.sinks}, {"rope_dims", o.sizing.rope_dims}};
  report["prompt"] = o.sizing.prompt;  // -1: one prefill; else errors at the decoded positions t >= prompt
  report["memories"] = nlohmann::json::array();
  for (const auto& k : kinds)
    report["memories"].push_back({{"id", k.id}, {"label", k.label}, {"sizing", k.sizing}, {"own_size", k.own_size}});
  report["buckets"] = nlohmann::json::array();
  for (const auto& [b, e] : buckets) report["buckets"].push_back({b, e});
  report["exact"] = {{"seconds", exact_seconds}};
  report["weights"] = nlohmann::json::object();  // memory -> the weights file its rows read
  for (const auto& [id, w] : trained_files) report["weights"][id] = w;
  report["results"] = nlohmann::json::array();

  OutView y("y", in.B, in.Hq, in.T, in.Dv);
  for (auto& job : jobs) {
    progress.step(job.kind->id + " at " + job.fraction_label);
    RunStats s;
    try {
      const auto t = trained.find(job.kind->id);
      s = job.plan.run(t == trained.end() ? stored : t->second, y);
    } catch (const invalid_argument& e) {
      rethrow_with_flag(e);
    }
    const auto yh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
    const auto m = compare(yh, ref, in.lengths, buckets, from);
    long held_tokens = 0;
    for (long b = 0; b < in.B; ++b) held_tokens += s.rows[b] + s.window[b];
    const double peak_fraction = static_cast<double>(s.peak_bytes) / static_cast<double>(full);
    nlohmann::json r;
    r["memory"] = job.kind->id;
    r["label"] = job.kind->label;
    r["weights"] = trained_files.count(job.kind->id) ? trained_files.at(job.kind->id)["file"] : nlohmann::json(nullptr);
    r["fraction_label"] = job.fraction_label;
    r["fraction"] = std::isnan(job.fraction) ? nlohmann::json(nullptr) : nlohmann::json(job.fraction);
    r["params"] = job.plan.params;
    r["summary"] = job.plan.summary;
    r["state_rows"] = s.rows;
    r["window_tokens"] = s.window;
    r["held_bytes"] = s.held_bytes;  // at the last token
    r["held_end_fraction"] = static_cast<double>(s.held_bytes) / static_cast<double>(full);
    r["held_end_token_fraction"] = static_cast<double>(held_tokens) / static_cast<double>(tokens);
    r["peak_bytes"] = s.peak_bytes;
    r["held_fraction"] = peak_fraction;  // the memory fraction reported and plotted: peak / full KV cache
    r["rel_l2"] = m.rel_l2;
    r["cosine_mean"] = m.cosine_mean;
    r["cosine_min"] = m.cosine_min;
    r["bucket_rel_l2"] = m.bucket_rel_l2;
    r["head_rel_l2"] = m.head_rel_l2;
    r["seconds"] = s.seconds;
    report["results"].push_back(r);
    progress.advance();
  }
  progress.finish();
  return report;
}

/// The terminal table.
inline void print_report(const nlohmann::json& r) {
  const auto& sh = r["shape"];
  std::printf("kvmem-eval  %s%sbackend=%s (%d threads)\n", r["label"].get<std::string>().c_str(),
              r["label"].get<std::string>().empty() ? "" : "  ", r["backend"]["name"].get<std::string>().c_str(),
              r["backend"]["concurrency"].get<int>());
  std::printf("  input   %s\n", r["input"].get<std::string>().c_str());
  std::printf("  shape   B=%ld  Hq=%ld  Hkv=%ld  T=%ld  D=%ld  Dv=%ld  (%ld tokens)\n", sh["B"].get<long>(),
              sh["Hq"].get<long>(), sh["Hkv"].get<long>(), sh["T"].get<long>(), sh["D"].get<long>(),
              sh["Dv"].get<long>(), sh["tokens"].get<long>());
  const auto dtype = r["dtype"].get<std::string>();
  std::printf("  dtype   memories in %s (input %s); the reference in float32\n", dtype.c_str(),
              r["input_dtype"].get<std::string>().c_str());
  std::printf("  exact   causal attention over the full KV cache (%s in %s): %.3f s\n",
              mib(r["full_kv_bytes"].get<long>()).c_str(), dtype.c_str(), r["exact"]["seconds"].get<double>());
  if (r.contains("prompt") && r["prompt"].get<long>() >= 0)
    std::printf("  prompt  the first %ld tokens in one prefill, then decode steps; errors at positions >= %ld\n",
                r["prompt"].get<long>(), r["prompt"].get<long>());
  std::printf("\n");
  std::printf("%-22s %-6s %-22s %6s %7s %10s %8s %9s %8s %8s\n", "memory", "budget", "parameters", "rows", "window",
              "held", "of cache", "rel L2", "cos", "wall s");
  for (const auto& x : r["results"]) {
    long rows = 0, win = 0;
    for (long v : x["state_rows"]) rows = std::max(rows, v);
    for (long v : x["window_tokens"]) win = std::max(win, v);
    std::printf("%-22s %-6s %-22s %6ld %7ld %10s %7.2f%% %9.4f %8.5f %8.3f\n", x["label"].get<std::string>().c_str(),
                x["fraction_label"].get<std::string>().c_str(), x["summary"].get<std::string>().c_str(), rows, win,
                mib(x["peak_bytes"].get<long>()).c_str(), 100.0 * x["held_fraction"].get<double>(),
                x["rel_l2"].get<double>(), x["cosine_mean"].get<double>(), x["seconds"].get<double>());
  }
  std::printf("\nrelative L2 error by position bucket (tokens)\n%-22s %-6s", "memory", "budget");
  for (const auto& b : r["buckets"]) std::printf(" %11s", fmt("%ld-%ld", b[0].get<long>(), b[1].get<long>() - 1).c_str());
  std::printf("\n");
  for (const auto& x : r["results"]) {
    std::printf("%-22s %-6s", x["label"].get<std::string>().c_str(), x["fraction_label"].get<std::string>().c_str());
    for (const auto& v : x["bucket_rel_l2"]) std::printf(" %11.4f", v.get<double>());
    std::printf("\n");
  }
  std::printf("\nrows, window: state rows (Trellis: slots m; eviction: sinks + kept tokens) and window tokens per head\n"
              "after the last token; held: the most the memory holds at any token (KVM, OVQ: state rows of (D + Dv + 1)\n"
              "float32 and a full window of (D + Dv) elements of the dtype and a float32 gate per token, per kv-head,\n"
              "their held_bytes(), plus the rows a kvm-h2o fold holds before its eviction; Trellis: m x (D + Dv) float32\n"
              "per query head; eviction: s + w + k + 1 rows of (D + Dv) elements of the dtype per kv-head); of cache:\n"
              "held / full KV cache (tokens x Hkv x (D + Dv) elements of the dtype); rel L2: ||y - y*|| / ||y*|| over all\n"
              "tokens and query heads, y widened to float32, y* exact attention in float32; cos: mean cosine similarity\n"
              "of y_t and y*_t; wall s: the memory's prefill.\n");
}

/// Runs `python3 script --output png json` and waits; throws std::runtime_error when it fails.
inline void draw_plot(const std::string& script, const std::string& json, const std::string& png) {
  std::vector<std::string> args{"python3", script, "--output", png, json};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::fflush(stdout);
  pid_t pid = 0;
  if (posix_spawnp(&pid, "python3", nullptr, nullptr, argv.data(), environ) != 0)
    throw std::runtime_error("--plot: cannot start python3 to run " + script);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw std::runtime_error("--plot: " + script + " failed (python3 with matplotlib is needed); the JSON is in " +
                             json);
}

}  // namespace kvmem::tools::eval

int main(int argc, char** argv) {
  namespace ev = kvmem::tools::eval;
  CLI::App app{"kvmem-eval: each memory's attention output against exact causal attention, per memory fraction"};
  ev::Options o;
  o.plot_script = KVMEM_EVAL_PLOT_SCRIPT;
  if (const char* s = std::getenv("KVMEM_EVAL_PLOT_SCRIPT")) o.plot_script = s;
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  auto* input = app.add_option("--input", o.input, "kvmem-run kvm input: q, k, v, gate, ln_weight, ln_bias, tau_state, tau_bswa [, lengths]");
  app.add_option("--fractions", o.fractions, "memory budgets as fractions of the full KV cache (1/8, 0.125 or 12.5%)")
      ->delimiter(',')->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)->capture_default_str();
  app.add_option("--memories", o.memories, "memories to compare (--list-memories)")
      ->delimiter(',')->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)->capture_default_str();
  app.add_option("--dtype", o.dtype, "the memories' storage type: f32, bf16 or f16 (default: tensor q's dtype; F64 runs as f32)");
  app.add_option("--json", o.json, "write the full report (every number, per bucket and head) here");
  app.add_option("--plot", o.plot, "draw error against memory fraction to this PNG (python3 + matplotlib)");
  app.add_option("--plot-script", o.plot_script, "the plot script (env KVMEM_EVAL_PLOT_SCRIPT)")->capture_default_str();
  app.add_option("--label", o.label, "a name for this input in the table, JSON and plot (e.g. 'layer 3')");
  app.add_option("--buckets", o.buckets, "position buckets for the error by position")->capture_default_str();
  app.add_option("--window-share", o.sizing.window_share, "s: share of the token budget f*T given to the window")->capture_default_str();
  app.add_option("--window-chunks", o.sizing.window_chunks, "n_b: chunks in the KVM window (chunk = s*f*T/n_b)")->capture_default_str();
  app.add_option("--sinks", o.sizing.sinks, "S: protected sink rows of KVM (eviction rows keep 4)")->capture_default_str();
  app.add_option("--rope-dims", o.sizing.rope_dims, "r: key channels with RoPE (0 for models without RoPE)")->capture_default_str();
  app.add_flag("--no-progress", o.no_progress, "no progress bar (it is drawn on stderr only when that is a terminal)");
  app.add_option("--weights", o.weights,
                 "trained weights (kvmem weights files of kvm-fixed, kvm-sqrt or ovq, from tools/distill/distill.py) "
                 "for the row each names (metadata memory_id); kvm's gate needs the input's attention input x [B, T, hidden]");
  app.add_option("--layer", o.layer, "the layer of --weights (default: the input's metadata 'layer')")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--prompt", o.sizing.prompt,
                 "P: the first P tokens in one prefill, the rest decode steps; errors at positions >= P (needed by "
                 "the rows that compress at the end of a prompt or per chunk)");
  app.add_flag("--list-memories", o.list, "list the memories and how each is sized for a fraction, then exit");
  try {
    app.parse(argc, argv);
    if (!o.list && !input->count()) throw CLI::RequiredError("--input");
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (o.list) {
    for (const auto& k : ev::memory_kinds<float>())
      std::printf("%-12s %s\n             %s\n", k.id.c_str(), k.label.c_str(), k.sizing.c_str());
    return 0;
  }
  if (!o.plot.empty() && o.json.empty()) o.json = o.plot.substr(0, o.plot.rfind('.')) + ".json";
  Kokkos::ScopeGuard guard;
  nlohmann::json report;
  try {
    report = ev::evaluate(o);
  } catch (const kvmem::invalid_argument& e) {
    std::fprintf(stderr, "kvmem-eval: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvmem-eval: failed: %s\n", e.what());
    return 1;
  }
  ev::print_report(report);
  try {
    if (!o.json.empty()) {
      std::ofstream f(o.json);
      f << report.dump(1) << "\n";
      if (!f) {
        std::fprintf(stderr, "kvmem-eval: error: --json = %s: cannot be written\n", o.json.c_str());
        return 2;
      }
      std::printf("json    %s\n", o.json.c_str());
    }
    if (!o.plot.empty()) {
      ev::draw_plot(o.plot_script, o.json, o.plot);
      std::printf("plot    %s\n", o.plot.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvmem-eval: failed: %s\n", e.what());
    return 1;
  }
  return 0;
}

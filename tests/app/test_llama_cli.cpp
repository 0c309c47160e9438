// The command line with a llama run, end to end: `kuai train` a tiny llama, `kuai sample` from
// the run, `kuai export --hf` it, `kuai sample --hf` from the export, and a new run started from
// the export with model.init_hf whose first loss is the trained model's, not a fresh one's.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>
#include <string>

#include "kuai/data/token_file.h"
#include "kuai/io/hf_llama.h"
#include "kuai/io/tensor_io.h"

#include "../support/run_kuai.h"

namespace kuai {
namespace {

namespace fs = std::filesystem;

std::pair<int, std::string> kuai(const std::string& args) { return test::run_kuai(args); }

double first_loss(const std::string& log) {
  std::smatch m;
  if (!std::regex_search(log, m, std::regex(R"(step +1/\d+ \| loss ([0-9.]+))"))) return -1;
  return std::stod(m[1]);
}

TEST(LlamaCli, TrainSampleExportAndFineTuneFromTheExport) {
  const fs::path root = fs::temp_directory_path() / "kuai_llama_cli";
  fs::remove_all(root);
  fs::create_directories(root);
  const std::string corpus = (root / "corpus.bin").string();  // a pattern a model can learn
  std::vector<int32_t> tokens(6000);
  for (size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<int32_t>("abcdefg hijk lmnop. "[i % 20]);
  data::write_token_file(corpus, tokens.data(), static_cast<int64_t>(tokens.size()), 1);
  const std::string tiny =
      "--data.path=" + corpus +
      " --model.family=llama --model.n_layer=2 --model.d_model=32 "
      "--model.n_head=4 --model.n_kv_head=2 --model.ffn_hidden=48 --model.seq_len=32 "
      "--model.vocab_size=256 --train.batch_size=4 --train.eval_every=0 --train.threads=1 "
      "--data.workers=1 --log.progress=plain --log.tensorboard=false --train.log_every=1 "
      "--run.dir=" +
      root.string();
  auto [rc, log] = kuai("train " + tiny + " --run.name=a --train.steps=30 --train.lr=1e-2");
  ASSERT_EQ(rc, 0) << log;
  EXPECT_NE(log.find("LLaMA, 2 layers, 4 heads (2 key/value)"), std::string::npos) << log;

  auto [src, sample] =
      kuai("sample --run " + (root / "a").string() + " --prompt abc --tokens 20 --temperature 0");
  ASSERT_EQ(src, 0) << sample;
  EXPECT_EQ(sample.rfind("abc", 0), 0u) << sample;

  const fs::path hf = root / "hf";
  auto [erc, elog] = kuai("export --run " + (root / "a").string() + " --hf " + hf.string());
  ASSERT_EQ(erc, 0) << elog;
  const io::HfCheckpoint c = io::read_hf(hf.string());
  EXPECT_EQ(c.config.n_kv_head, 2);
  // The same greedy text from the run and from its Hugging Face export.
  auto [hrc, hsample] = kuai("sample --hf " + hf.string() +
                             " --prompt abc --tokens 20 "
                             "--temperature 0");
  ASSERT_EQ(hrc, 0) << hsample;
  EXPECT_EQ(hsample, sample);

  // Fine-tuning from the export: the first loss is (within the two runs' fp32 noise) the trained
  // model's on the same first batch, far below a fresh model's.
  auto [frc, fresh] = kuai("train " + tiny + " --run.name=fresh --train.steps=1");
  auto [trc, tuned] =
      kuai("train " + tiny + " --run.name=tuned --train.steps=1 --model.init_hf=" + hf.string());
  ASSERT_EQ(frc, 0) << fresh;
  ASSERT_EQ(trc, 0) << tuned;
  EXPECT_LT(first_loss(tuned), first_loss(fresh) - 0.5) << fresh << tuned;

  // A model of another shape is refused with both shapes named.
  auto [brc, bad] = kuai("train " + tiny +
                         " --run.name=bad --train.steps=1 --model.n_layer=3 "
                         "--model.init_hf=" +
                         hf.string());
  EXPECT_NE(brc, 0);
  EXPECT_NE(bad.find("config.json describes another model: num_hidden_layers 2 (the model has 3)"),
            std::string::npos)
      << bad;
  // A shorter training window than the export's positions is fine (rotary: no position table).
  auto [src2, shorter] = kuai("train " + tiny + " --run.name=short --train.steps=1 " +
                              "--model.seq_len=16 --model.init_hf=" + hf.string());
  EXPECT_EQ(src2, 0) << shorter;
  // A bad option value is named.
  auto [grc, g] =
      kuai("export --run " + (root / "a").string() + " --hf " + hf.string() + " --dtype f64");
  EXPECT_NE(grc, 0);
  EXPECT_NE(g.find("--dtype"), std::string::npos) << g;
  fs::remove_all(root);
}

}  // namespace
}  // namespace kuai

// Config loading: TOML + overrides, every bad input a one-line error naming the key.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "kuai/data/token_file.h"
#include "kuai/train/config.h"
#include "kuai/train/trainer.h"

#include <sstream>

namespace kuai::train {
namespace {

std::string error_of(const std::string& toml, const std::vector<std::string>& overrides) {
  std::string path;
  if (!toml.empty()) {
    path = (std::filesystem::temp_directory_path() / "kuai_test_config.toml").string();
    std::ofstream(path) << toml;
  }
  try {
    load_config(path, overrides);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(Config, DefaultsOverridesAndRoundTrip) {
  TrainConfig c = load_config("", {"--model.n_layer=2", "--train.lr=3e-4",
                                   "--data.source=synthetic", "--data.path=x y.bin"});
  EXPECT_EQ(c.model.n_layer, 2);
  EXPECT_DOUBLE_EQ(c.lr, 3e-4);
  EXPECT_EQ(c.data_source, "synthetic");
  EXPECT_EQ(c.data_path, "x y.bin");
  const std::string text = to_toml(c);
  const auto path = (std::filesystem::temp_directory_path() / "kuai_roundtrip.toml").string();
  std::ofstream(path) << text;
  TrainConfig back = load_config(path, {});
  EXPECT_EQ(to_toml(back), text);

  // Strings that need escaping (quotes, backslash, newline, ''', control characters).
  TrainConfig odd;
  odd.data_path = "a'''\nb\"c\\d\te\x01f";
  odd.run_dir = "runs \"x\"";
  const TrainConfig odd_back = load_config_text(to_toml(odd), "odd.toml");
  EXPECT_EQ(odd_back.data_path, odd.data_path);
  EXPECT_EQ(odd_back.run_dir, odd.run_dir);
}

TEST(Config, ErrorsNameTheKey) {
  EXPECT_NE(error_of("", {"--model.n_layers=2"})
                .find("unknown key 'model.n_layers' (did you mean 'model.n_layer'?)"),
            std::string::npos);
  EXPECT_NE(error_of("[train]\nlr = \"fast\"\n", {}).find("train.lr must be a number"),
            std::string::npos);
  EXPECT_NE(error_of("", {"--train.batch_size=0"}).find("train.batch_size = 0 is out of range"),
            std::string::npos);
  EXPECT_NE(error_of("", {"--data.source=web"})
                .find("data.source = \"web\" is not one of \"file\", \"synthetic\""),
            std::string::npos);
  EXPECT_NE(error_of("[model]\nd_model = 30\nn_head = 4\n", {})
                .find("model.d_model (30) must be divisible"),
            std::string::npos);
  EXPECT_NE(error_of("[model\n", {}).find("kuai_test_config.toml:1"), std::string::npos);
  EXPECT_NE(error_of("", {"model.n_layer"}).find("not of the form"), std::string::npos);
  try {
    load_config("/nonexistent/run.toml", {});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "config: /nonexistent/run.toml: no such file");
  }
  EXPECT_NE(error_of("[optim]\nlr = 1\n", {}).find("unknown key 'optim.lr'"), std::string::npos);
  // The trainer's keys.
  EXPECT_NE(error_of("", {"--data.workers=-1"}).find("data.workers = -1 is out of range [0, 64]"),
            std::string::npos);
  EXPECT_NE(
      error_of("", {"--log.progress=fancy"})
          .find("log.progress = \"fancy\" is not one of \"auto\", \"bar\", \"plain\", \"off\""),
      std::string::npos);
  EXPECT_NE(error_of("[log]\njsonl = \"yes\"\n", {}).find("log.jsonl must be true or false"),
            std::string::npos);
  EXPECT_NE(error_of("", {"--train.accum_step=4"})
                .find("unknown key 'train.accum_step' (did you mean 'train.accum_steps'?)"),
            std::string::npos);
  EXPECT_NE(error_of("", {"--run.name=a/b"}).find("run.name = \"a/b\" must be a plain name"),
            std::string::npos);
  EXPECT_NE(
      error_of("", {"--data.val_fraction=0.9"}).find("data.val_fraction = 0.9 is out of range"),
      std::string::npos);
  EXPECT_NE(error_of("", {"--train.precision=fp8"})
                .find("train.precision = \"fp8\" is not one of \"fp32\", \"bf16\", \"fp16\""),
            std::string::npos);
  EXPECT_NE(error_of("", {"--dist.zero=4"}).find("dist.zero = 4 is out of range [0, 3]"),
            std::string::npos);
  // Compression combines with every ZeRO stage (the reduce-scatter of stages 2 and 3 goes through
  // the wire dtype as the all-reduce does).
  for (const std::string zero : {"1", "2", "3"})
    EXPECT_EQ(error_of("", {"--dist.zero=" + zero, "--dist.compression=bf16"}), "") << zero;
  // A float where an integer belongs, even one beyond int64 (the fuzzer's find: converting it
  // was undefined behaviour before the type was checked).
  EXPECT_NE(error_of("[model]\nd_model = 1666666666666666666666666666.5\n", {})
                .find("model.d_model must be an integer"),
            std::string::npos);
  EXPECT_NE(error_of("", {"--model.n_layer=2.0"}).find("model.n_layer must be an integer"),
            std::string::npos);
  // The llama family's keys.
  EXPECT_NE(error_of("", {"--model.family=mamba"})
                .find("model.family = \"mamba\" is not one of \"gpt2\", \"llama\""),
            std::string::npos);
  EXPECT_NE(error_of("", {"--model.n_kv_head=2"}).find("model.n_kv_head = 2 needs family"),
            std::string::npos);
  EXPECT_NE(error_of("", {"--model.family=llama", "--model.n_kv_head=3"})
                .find("model.n_kv_head (3) must divide model.n_head (4)"),
            std::string::npos);
  EXPECT_NE(error_of("", {"--model.family=llama", "--model.n_head=128", "--model.d_model=128"})
                .find("must be even for rotary positions"),
            std::string::npos);
  EXPECT_NE(error_of("", {"--model.rope_theta=0"}).find("model.rope_theta = 0 is out of range"),
            std::string::npos);
  EXPECT_NE(error_of("", {"--model.init_hf=x"}).find("model.init_hf = \"x\" needs model.family"),
            std::string::npos);
  EXPECT_EQ(error_of("", {"--model.family=llama", "--model.n_kv_head=1"}), "");
}

TEST(Config, RunNameDefaultsToTheConfigStem) {
  const auto path = (std::filesystem::temp_directory_path() / "my_run.toml").string();
  std::ofstream(path) << "[train]\nsteps = 3\n";
  EXPECT_EQ(load_config(path, {}).run_name, "my_run");
  EXPECT_EQ(load_config(path, {"--run.name=other"}).run_name, "other");
  EXPECT_EQ(load_config("", {}).run_name, "run");
}

TEST(Trainer, LearningRateSchedule) {
  TrainConfig c;
  c.lr = 1.0;
  c.min_lr_ratio = 0.1;
  c.warmup_steps = 10;
  c.steps = 110;
  EXPECT_DOUBLE_EQ(learning_rate(c, 0), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(c, 9), 1.0);
  EXPECT_NEAR(learning_rate(c, 10), 1.0, 1e-12);
  EXPECT_NEAR(learning_rate(c, 60), 0.55, 1e-12);
  EXPECT_NEAR(learning_rate(c, 110), 0.1, 1e-12);
}

TEST(Trainer, LossFallsOnALearnableCorpus) {
  // A periodic corpus: the next byte is a function of the current one; a tiny GPT learns it.
  std::vector<int32_t> tokens(20000);
  for (size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<int32_t>("kuai trains fast. "[i % 18]);
  const auto path = (std::filesystem::temp_directory_path() / "kuai_periodic.bin").string();
  data::write_token_file(path, tokens.data(), static_cast<int64_t>(tokens.size()), 1);
  TrainConfig c = load_config(
      "", {"--model.n_layer=1", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=32",
           "--train.batch_size=8", "--train.steps=60", "--train.lr=1e-2", "--train.warmup_steps=5",
           "--train.log_every=1000", "--data.path=" + path});
  std::ostringstream log;
  TrainOptions o;
  o.write_run_dir = false;
  TrainResult r = run_training(c, log, o);
  ASSERT_EQ(r.losses.size(), 60u);
  EXPECT_GT(r.losses.front(), 5.0f);  // ~ln 256 at initialisation
  EXPECT_LT(r.losses.back(), 1.0f);
  EXPECT_GT(r.tokens_per_s, 0);
}

TEST(Trainer, BadDataFileIsAClearError) {
  TrainConfig c = load_config("", {"--data.path=/nonexistent/kuai.bin"});
  std::ostringstream log;
  try {
    run_training(c, log);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/kuai.bin: cannot open token file"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace kuai::train

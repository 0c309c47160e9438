// The metric ring: device values are read by the logger thread, not at push; steps reach the sinks
// in order, lagged, and all of them by flush; sink failures surface; the JSONL and console sinks.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <stdexcept>

#include "kuai/core/ops.h"
#include "kuai/log/metrics.h"
#include "kuai/log/sinks.h"

namespace kuai::log {
namespace {

struct Recorder final : MetricSink {
  std::mutex* mu;
  std::vector<LoggedStep>* seen;
  int64_t* newest_pushed;
  bool* lag_violated;
  bool* flushing;
  int64_t lag;
  void write(const LoggedStep& s) override {
    std::lock_guard<std::mutex> lock(*mu);
    if (!*flushing && s.step > *newest_pushed - lag) *lag_violated = true;
    seen->push_back(s);
  }
};

StepMetrics step_of(int64_t step, const Tensor& loss) {
  StepMetrics m;
  m.step = step;
  m.wall_time = 1000.0 + static_cast<double>(step);
  m.device = {{"loss", loss}};
  m.host = {{"lr", 0.5 * static_cast<double>(step)}};
  return m;
}

TEST(MetricRing, ConvertsLaterInOrderAndAllByFlush) {
  std::mutex mu;
  std::vector<LoggedStep> seen;
  int64_t newest = 0;
  bool violated = false, flushing = false;
  const int64_t lag = 3;
  std::vector<std::unique_ptr<MetricSink>> sinks;
  auto rec = std::make_unique<Recorder>();
  rec->mu = &mu;
  rec->seen = &seen;
  rec->newest_pushed = &newest;
  rec->lag_violated = &violated;
  rec->flushing = &flushing;
  rec->lag = lag;
  sinks.push_back(std::move(rec));
  MetricRing ring(std::move(sinks), lag);
  for (int64_t s = 1; s <= 20; ++s) {
    {
      std::lock_guard<std::mutex> lock(mu);
      newest = s;  // set before the push: the sink may see step s - lag from now on
    }
    ring.push(step_of(s, full({}, static_cast<float>(s) * 0.25f)));
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    flushing = true;  // from here on, the remaining steps are due regardless of the lag
  }
  ring.flush();
  ASSERT_EQ(seen.size(), 20u);
  for (int64_t s = 1; s <= 20; ++s) {
    const LoggedStep& l = seen[static_cast<size_t>(s - 1)];
    EXPECT_EQ(l.step, s);
    EXPECT_EQ(l.get("loss"), static_cast<float>(s) * 0.25f);
    EXPECT_EQ(l.get("lr"), 0.5 * static_cast<double>(s));
    EXPECT_EQ(l.wall_time, 1000.0 + static_cast<double>(s));
  }
  // Before flush, no step newer than (newest pushed - lag) reached a sink.
  EXPECT_FALSE(violated);
  EXPECT_EQ(ring.history().size(), 20u);
}

TEST(MetricRing, PushDoesNotReadTheDeviceValue) {
  // The value is changed after the push; the logger, reading `lag` steps later, sees the change.
  // (A ring that read at push time would log 1.)
  MetricRing ring({}, /*lag=*/5);
  Tensor t = full({}, 1.0f);
  ring.push(step_of(1, t));
  t.data<float>()[0] = 2.0f;
  ring.flush();
  ASSERT_EQ(ring.history().size(), 1u);
  EXPECT_EQ(ring.history()[0].get("loss"), 2.0);
}

struct Failing final : MetricSink {
  void write(const LoggedStep&) override { throw std::runtime_error("disk full"); }
};

TEST(MetricRing, SinkFailureSurfacesOnFlush) {
  std::vector<std::unique_ptr<MetricSink>> sinks;
  sinks.push_back(std::make_unique<Failing>());
  MetricRing ring(std::move(sinks), 0);
  ring.push(step_of(1, full({}, 1.0f)));
  try {
    ring.flush();
    FAIL() << "flush should rethrow the sink's error";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "disk full");
  }
}

TEST(Sinks, JsonlOneObjectPerStepWithNullForNonFinite) {
  const auto path = (std::filesystem::temp_directory_path() / "kuai_metrics.jsonl").string();
  {
    JsonlSink sink(path);
    LoggedStep a{1, 12.5, {{"loss", 2.5}, {"lr", 1e-3}}};
    LoggedStep b{2, 13.0, {{"loss", std::nan("")}, {"val_loss", 1.25}}};
    sink.write(a);
    sink.write(b);
    sink.flush();
  }
  std::ifstream in(path);
  std::string line;
  std::vector<nlohmann::json> rows;
  while (std::getline(in, line)) rows.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0]["step"], 1);
  EXPECT_DOUBLE_EQ(rows[0]["loss"].get<double>(), 2.5);
  EXPECT_DOUBLE_EQ(rows[0]["lr"].get<double>(), 1e-3);
  EXPECT_TRUE(rows[1]["loss"].is_null());
  EXPECT_DOUBLE_EQ(rows[1]["val_loss"].get<double>(), 1.25);
}

TEST(Sinks, ConsolePlainLinesAndBar) {
  std::ostringstream plain;
  ConsoleSink c(plain, ConsoleMode::kPlain, /*total=*/10, /*log_every=*/4);
  for (int64_t s = 1; s <= 10; ++s) c.write(LoggedStep{s, double(s), {{"loss", 1.0}}});
  c.write(LoggedStep{10, 10.0, {{"val_loss", 0.5}}});
  c.flush();
  const std::string text = plain.str();
  EXPECT_NE(text.find("step     1/10"), std::string::npos);
  EXPECT_NE(text.find("step     4/10"), std::string::npos);
  EXPECT_NE(text.find("step     8/10"), std::string::npos);
  EXPECT_NE(text.find("step    10/10"), std::string::npos);
  EXPECT_EQ(text.find("step     2/10"), std::string::npos);
  EXPECT_NE(text.find("val loss 0.5000"), std::string::npos);
  EXPECT_EQ(text.find('\r'), std::string::npos);

  std::ostringstream bar;
  ConsoleSink b(bar, ConsoleMode::kBar, 10, 4);
  // A push moves the bar before any loss has been read.
  b.pushed(LoggedStep{1, 0.0, {{"lr", 1e-3}, {"tokens_per_s", 1000.0}}});
  EXPECT_NE(bar.str().find("1/10 | loss   ...   | lr 1.00e-03"), std::string::npos);
  b.write(LoggedStep{1, 0.0, {{"loss", 3.0}, {"lr", 1e-3}, {"tokens_per_s", 1000.0}}});
  b.write(LoggedStep{5, 2.0, {{"loss", 2.0}, {"lr", 1e-3}, {"tokens_per_s", 1000.0}}});
  b.flush();
  EXPECT_NE(bar.str().find('\r'), std::string::npos);
  EXPECT_NE(bar.str().find(" 50% [############............] 5/10"), std::string::npos);
  EXPECT_NE(bar.str().find("ETA 0:03"), std::string::npos);  // 0.5 s/step x 5 steps left
  EXPECT_EQ(format_duration(3725), "1:02:05");
}

}  // namespace
}  // namespace kuai::log

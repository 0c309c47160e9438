// Where logged steps go: the console (a progress bar on a terminal, plain lines otherwise), a
// JSONL file (one object per step), and TensorBoard event files. All run on the logger thread.
#pragma once

#include <cmath>
#include <cstdint>
#include <fstream>
#include <memory>
#include <ostream>
#include <string>

#include "kuai/log/metrics.h"

namespace kuai::log {

class EventWriter;

enum class ConsoleMode { kBar, kPlain, kOff };

// kBar redraws one line per logged step ("\r"); evaluation results print above it. kPlain prints
// a line at step 1, every `log_every` steps and the last step, and one per evaluation.
class ConsoleSink final : public MetricSink {
 public:
  ConsoleSink(std::ostream& out, ConsoleMode mode, int64_t total_steps, int64_t log_every);
  void write(const LoggedStep& s) override;
  void pushed(const LoggedStep& host_only) override;  // kBar: moves the bar right away
  void flush() override;

 private:
  void draw_bar(int64_t step, double wall_time, double lr, double tokens_per_s);
  void start_clock(const LoggedStep& s);
  std::ostream& out_;
  ConsoleMode mode_;
  int64_t total_;
  int64_t log_every_;
  double start_wall_ = -1.0;
  int64_t start_step_ = 0;
  bool bar_drawn_ = false;
  double last_loss_ = NAN;  // newest loss read by the logger (the bar shows it until the next)
  int64_t drawn_step_ = 0;
};

// One JSON object per line: {"step": 12, "wall_time": ..., "loss": ..., ...}; non-finite values
// are written as null.
class JsonlSink final : public MetricSink {
 public:
  explicit JsonlSink(const std::string& path, bool append = false);
  void write(const LoggedStep& s) override;
  void flush() override;

 private:
  std::string path_;
  std::ofstream out_;
};

// Every value as a TensorBoard scalar "<prefix><name>" (e.g. "train/loss").
class TensorBoardSink final : public MetricSink {
 public:
  explicit TensorBoardSink(const std::string& dir, std::string prefix = "train/");
  ~TensorBoardSink() override;
  void write(const LoggedStep& s) override;
  void flush() override;
  const std::string& path() const;

 private:
  std::unique_ptr<EventWriter> writer_;
  std::string prefix_;
};

// "1:05:03" / "4:07" for a number of seconds.
std::string format_duration(double seconds);

}  // namespace kuai::log

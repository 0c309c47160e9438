// Console, JSONL and TensorBoard sinks (see sinks.h).
#include "kuai/log/sinks.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "kuai/log/event_writer.h"

namespace kuai::log {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<int64_t>(std::llround(seconds));
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

namespace {

std::string rate(double tokens_per_s) {
  if (tokens_per_s >= 1e6) return fmt::format("{:.2f}M", tokens_per_s / 1e6);
  if (tokens_per_s >= 1e4) return fmt::format("{:.1f}k", tokens_per_s / 1e3);
  return fmt::format("{:.0f}", tokens_per_s);
}

}  // namespace

ConsoleSink::ConsoleSink(std::ostream& out, ConsoleMode mode, int64_t total_steps,
                         int64_t log_every)
    : out_(out), mode_(mode), total_(total_steps), log_every_(std::max<int64_t>(1, log_every)) {}

void ConsoleSink::start_clock(const LoggedStep& s) {
  if (start_wall_ < 0) {
    start_wall_ = s.wall_time;
    start_step_ = s.step;
  }
}

void ConsoleSink::draw_bar(int64_t step, double wall_time, double lr, double tokens_per_s) {
  constexpr int kWidth = 24;
  const double frac = total_ > 0 ? std::clamp(double(step) / double(total_), 0.0, 1.0) : 1.0;
  std::string bar(static_cast<size_t>(frac * kWidth), '#');
  bar.resize(kWidth, '.');
  std::string eta = "?";
  if (start_wall_ >= 0 && step > start_step_) {
    const double per_step = (wall_time - start_wall_) / double(step - start_step_);
    eta = format_duration(per_step * double(total_ - step));
  }
  const std::string loss = std::isnan(last_loss_) ? "  ...  " : fmt::format("{:.4f}", last_loss_);
  out_ << "\r\033[K"
       << fmt::format("{:3.0f}% [{}] {}/{} | loss {} | lr {:.2e} | {} tok/s | ETA {}", 100.0 * frac,
                      bar, step, total_, loss, lr, rate(tokens_per_s), eta)
       << std::flush;
  bar_drawn_ = true;
  drawn_step_ = step;
}

void ConsoleSink::pushed(const LoggedStep& s) {
  if (mode_ != ConsoleMode::kBar) return;
  start_clock(s);
  draw_bar(s.step, s.wall_time, s.get("lr"), s.get("tokens_per_s"));
}

void ConsoleSink::write(const LoggedStep& s) {
  if (mode_ == ConsoleMode::kOff) return;
  start_clock(s);
  const bool has_val = s.has("val_loss");
  if (mode_ == ConsoleMode::kBar) {
    if (s.has("loss")) last_loss_ = s.get("loss");
    if (has_val)
      out_ << "\r\033[K" << fmt::format("step {}: val loss {:.4f}\n", s.step, s.get("val_loss"));
    // Redraw at the newest step shown so far: the loss read now belongs to an older step.
    if (s.step >= drawn_step_)
      draw_bar(s.step, s.wall_time, s.get("lr"), s.get("tokens_per_s"));
    else if (has_val)
      bar_drawn_ = false;
    return;
  }
  if (s.step == 1 || s.step % log_every_ == 0 || s.step == total_) {
    out_ << fmt::format(
        "step {:>5}/{} | loss {:.4f} | lr {:.2e} | norm {:.3f} | {:.1f} ms | {:.0f} tok/s | data "
        "wait {:.2f} ms\n",
        s.step, total_, s.get("loss"), s.get("lr"), s.get("grad_norm"), s.get("step_ms"),
        s.get("tokens_per_s"), s.get("data_wait_ms"));
  }
  if (has_val)
    out_ << fmt::format("step {:>5}/{} | val loss {:.4f}\n", s.step, total_, s.get("val_loss"));
  out_.flush();
}

void ConsoleSink::flush() {
  if (bar_drawn_) {
    out_ << "\n";
    bar_drawn_ = false;
  }
  out_.flush();
}

JsonlSink::JsonlSink(const std::string& path, bool append)
    : path_(path), out_(path, append ? std::ios::app : std::ios::trunc) {
  if (!out_) throw std::runtime_error(fmt::format("{}: cannot open for writing", path));
}

void JsonlSink::write(const LoggedStep& s) {
  std::string line = fmt::format("{{\"step\": {}, \"wall_time\": {:.3f}", s.step, s.wall_time);
  for (const auto& [k, v] : s.values) {
    if (std::isfinite(v))
      line += fmt::format(", \"{}\": {}", k, v);
    else
      line += fmt::format(", \"{}\": null", k);
  }
  line += "}\n";
  out_ << line;
  if (!out_) throw std::runtime_error(fmt::format("{}: write failed", path_));
}

void JsonlSink::flush() {
  out_.flush();
  if (!out_) throw std::runtime_error(fmt::format("{}: write failed", path_));
}

TensorBoardSink::TensorBoardSink(const std::string& dir, std::string prefix)
    : writer_(std::make_unique<EventWriter>(dir)), prefix_(std::move(prefix)) {}

TensorBoardSink::~TensorBoardSink() = default;

void TensorBoardSink::write(const LoggedStep& s) {
  std::vector<std::pair<std::string, float>> tags;
  for (const auto& [k, v] : s.values) {
    // "val_loss" -> "val/loss"; everything else under the training prefix.
    const std::string tag = k.rfind("val_", 0) == 0 ? "val/" + k.substr(4) : prefix_ + k;
    tags.emplace_back(tag, static_cast<float>(v));
  }
  writer_->add_scalars(s.step, s.wall_time, tags);
}

void TensorBoardSink::flush() { writer_->flush(); }

const std::string& TensorBoardSink::path() const { return writer_->path(); }

}  // namespace kuai::log

// Full checkpoints: snapshot, asynchronous atomic write, verified load (see checkpoint.h).
#include "kuai/train/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "kuai/core/version.h"
#include "kuai/io/checksum.h"
#include "kuai/io/safetensors.h"

namespace kuai::train {

namespace fs = std::filesystem;

namespace {

constexpr int kStateVersion = 1;
constexpr char kModelFile[] = "model.safetensors";
constexpr char kOptimFile[] = "optimizer.rank0.safetensors";
constexpr char kConfigFile[] = "config.toml";
constexpr char kStateFile[] = "state.json";
constexpr char kLatest[] = "latest";

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

[[noreturn]] void io_error(const std::string& path, const std::string& what) {
  throw std::runtime_error(fmt::format("{}: {}: {}", path, what, std::strerror(errno)));
}

// Writes `data` to `path` and fsyncs it before returning.
void write_file_synced(const std::string& path, const void* data, size_t n) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) io_error(path, "cannot create");
  const char* p = static_cast<const char*>(data);
  size_t left = n;
  while (left > 0) {
    const ssize_t w = ::write(fd, p, left);
    if (w < 0) {
      if (errno == EINTR) continue;
      const int saved = errno;
      ::close(fd);
      errno = saved;
      io_error(path, "write failed");
    }
    p += w;
    left -= static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0) {
    const int saved = errno;
    ::close(fd);
    errno = saved;
    io_error(path, "fsync failed");
  }
  if (::close(fd) != 0) io_error(path, "close failed");
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) io_error(dir, "cannot open directory");
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) io_error(dir, "fsync of directory failed");
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("{}: cannot open", path));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Step of a "ckpt-<step>" directory name, or -1.
int64_t step_of(const std::string& name) {
  if (name.rfind("ckpt-", 0) != 0 || name.size() <= 5) return -1;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || v > (int64_t{1} << 50)) return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

struct Blob {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};

// Copies `t` into `b`, reusing b's buffer when it already has the size (the usual case from the
// second save on: no allocation, no page faults, one pass over the bytes).
void copy_into(Blob& b, const std::string& name, const Tensor& t) {
  const Tensor c = t.contiguous();
  const size_t n = static_cast<size_t>(c.numel()) * sizeof(float);
  b.name = name;
  b.shape = c.shape();
  if (b.bytes.size() != n) b.bytes = std::vector<std::byte>(n);
  std::memcpy(b.bytes.data(), c.data<float>(), n);
}

void write_blobs(const std::string& path, const std::vector<Blob>& blobs, const std::string& kind) {
  std::vector<io::SafetensorsView> views;
  views.reserve(blobs.size());
  for (const Blob& b : blobs)
    views.push_back(
        {b.name, "F32", b.shape, b.bytes.data(), static_cast<uint64_t>(b.bytes.size())});
  io::write_safetensors(path, views, {{"kuai.format", kind}, {"kuai.version", kKuaiVersion}});
}

// (group, index) -> parameter name, through the identity of the tensors.
std::vector<std::vector<std::string>> optimizer_names(const nn::GPT& model,
                                                      const optim::AdamW& opt) {
  std::map<const void*, std::string> by_impl;
  for (const auto& [name, p] : model.named_parameters()) by_impl[p.impl()] = name;
  std::vector<std::vector<std::string>> names;
  for (const optim::ParamGroup& g : opt.groups()) {
    names.emplace_back();
    for (const Tensor& p : g.params) {
      auto it = by_impl.find(p.impl());
      if (it == by_impl.end())
        throw std::invalid_argument("checkpoint: an optimizer parameter is not in the model");
      names.back().push_back(it->second);
    }
  }
  return names;
}

// Copies entry `name` of `file` (F32, `shape`) into `dst`, or throws naming the check.
void load_entry(const io::SafetensorsFile& file, const std::string& name, const Tensor& dst) {
  const io::SafetensorsEntry* e = file.find(name);
  if (!e) throw std::runtime_error(fmt::format("{}: tensor '{}' is missing", file.path(), name));
  if (e->dtype != "F32")
    throw std::runtime_error(
        fmt::format("{}: tensor '{}' has dtype {}, expected F32", file.path(), name, e->dtype));
  if (e->shape != dst.shape())
    throw std::runtime_error(fmt::format("{}: tensor '{}' has shape {}, expected {}", file.path(),
                                         name, shape_str(e->shape), shape_str(dst.shape())));
  if (!dst.is_contiguous())
    throw std::invalid_argument("checkpoint: destination tensor is not contiguous");
  const auto bytes = file.data(*e);
  std::memcpy(dst.data<float>(), bytes.data(), bytes.size());
}

}  // namespace

struct Checkpointer::Snapshot {
  TrainingState state;
  int64_t optimizer_steps = 0;
  std::vector<Blob> model, optim;
};

Checkpointer::Checkpointer(std::string run_dir, int64_t keep_last, bool async)
    : run_dir_(std::move(run_dir)), keep_last_(std::max<int64_t>(1, keep_last)), async_(async) {
  std::error_code ec;
  fs::create_directories(run_dir_, ec);
  if (ec) throw std::runtime_error(fmt::format("{}: cannot create: {}", run_dir_, ec.message()));
  // Leftovers of a save that was killed: never valid, never pointed to.
  for (const auto& e : fs::directory_iterator(run_dir_)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("ckpt-", 0) == 0 && (n.ends_with(".tmp") || n.ends_with(".old")))
      fs::remove_all(e.path(), ec);
  }
  if (async_) thread_ = std::thread([this] { writer_main(); });
}

Checkpointer::~Checkpointer() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !busy_; });
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

double Checkpointer::save(const nn::GPT& model, optim::AdamW& opt, const TrainingState& state) {
  const auto t0 = Clock::now();
  wait();  // at most one save in flight; a failed previous save surfaces here
  std::unique_ptr<Snapshot> snap;
  {
    std::lock_guard<std::mutex> lock(mu_);
    snap = std::move(spare_);  // the previous save's buffers, written and idle
  }
  if (!snap) snap = std::make_unique<Snapshot>();
  snap->state = state;
  snap->optimizer_steps = opt.step_count();
  const auto params = model.named_parameters();
  snap->model.resize(params.size());
  for (size_t i = 0; i < params.size(); ++i)
    copy_into(snap->model[i], params[i].first, params[i].second);
  opt.ensure_state();
  const auto names = optimizer_names(model, opt);
  size_t n = 0;
  for (const auto& g : names) n += 2 * g.size();
  snap->optim.resize(n);
  size_t j = 0;
  for (size_t g = 0; g < names.size(); ++g)
    for (size_t i = 0; i < names[g].size(); ++i) {
      copy_into(snap->optim[j++], "exp_avg." + names[g][i], opt.exp_avg()[g][i]);
      copy_into(snap->optim[j++], "exp_avg_sq." + names[g][i], opt.exp_avg_sq()[g][i]);
    }
  const double blocked = ms_since(t0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.blocked_ms = blocked;
  }
  if (!async_) {
    write(*snap);
    std::lock_guard<std::mutex> lock(mu_);
    spare_ = std::move(snap);
    return ms_since(t0);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_ = std::move(snap);
    busy_ = true;
  }
  cv_.notify_all();
  return blocked;
}

void Checkpointer::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !busy_; });
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

SaveStats Checkpointer::last_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Checkpointer::writer_main() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || pending_ != nullptr; });
    if (!pending_) return;  // stop_
    std::unique_ptr<Snapshot> snap = std::move(pending_);
    lock.unlock();
    std::exception_ptr err;
    try {
      write(*snap);
    } catch (...) {
      err = std::current_exception();
    }
    lock.lock();
    spare_ = std::move(snap);  // kept for the next save's snapshot
    if (err) error_ = err;
    busy_ = false;
    cv_.notify_all();
  }
}

void Checkpointer::write(const Snapshot& s) {
  const auto t0 = Clock::now();
  const std::string name = fmt::format("ckpt-{}", s.state.step);
  const std::string final_dir = run_dir_ + "/" + name, tmp = final_dir + ".tmp";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  if (!fs::create_directory(tmp, ec) || ec)
    throw std::runtime_error(fmt::format("{}: cannot create: {}", tmp, ec.message()));
  write_blobs(tmp + "/" + kModelFile, s.model, "checkpoint-model");
  write_blobs(tmp + "/" + kOptimFile, s.optim, "checkpoint-optimizer");
  write_file_synced(tmp + "/" + kConfigFile, s.state.config_toml.data(),
                    s.state.config_toml.size());

  nlohmann::json st = {{"format", "kuai-checkpoint"},
                       {"version", kStateVersion},
                       {"kuai_version", kKuaiVersion},
                       {"step", s.state.step},
                       {"optimizer_steps", s.optimizer_steps},
                       {"loader", {{"next_index", s.state.loader.next_index}}},
                       {"data_seed", s.state.data_seed},
                       {"loss_scale", nullptr},  // fp32 and bf16: no scaler
                       {"world_size", 1}};
  if (s.state.loss_scale)
    st["loss_scale"] = {{"scale", s.state.loss_scale->scale},
                        {"growth_tracker", s.state.loss_scale->growth_tracker}};
  int64_t bytes = 0;
  for (const char* f : {kModelFile, kOptimFile, kConfigFile}) {
    const std::string content = read_file(tmp + "/" + f);  // what is on disk now
    st["files"][f] = {{"bytes", content.size()},
                      {"xxh3", io::xxh3_hex(content.data(), content.size())}};
    bytes += static_cast<int64_t>(content.size());
  }
  const std::string state_text = st.dump(2) + "\n";
  write_file_synced(tmp + "/" + kStateFile, state_text.data(), state_text.size());
  bytes += static_cast<int64_t>(state_text.size());
  fsync_dir(tmp);

  // Into place. A checkpoint of the same step (a stop right after a periodic save) is replaced
  // only now that the new one is complete; `latest` never names a partial directory.
  if (fs::exists(final_dir)) {
    const std::string old = final_dir + ".old";
    fs::remove_all(old, ec);
    fs::rename(final_dir, old);
    fs::rename(tmp, final_dir);
    fs::remove_all(old, ec);
  } else {
    fs::rename(tmp, final_dir);
  }
  fsync_dir(run_dir_);
  const std::string latest_tmp = run_dir_ + "/" + kLatest + ".tmp";
  const std::string pointer = name + "\n";
  write_file_synced(latest_tmp, pointer.data(), pointer.size());
  fs::rename(latest_tmp, run_dir_ + "/" + kLatest);
  fsync_dir(run_dir_);

  // Keep the newest keep_last checkpoints (the one just written is the newest by step unless a
  // resumed run went back; it is never removed).
  std::vector<std::string> all = list_checkpoints(run_dir_);
  int64_t excess = static_cast<int64_t>(all.size()) - keep_last_;
  for (const std::string& dir : all) {
    if (excess <= 0) break;
    if (dir == final_dir) continue;
    fs::remove_all(dir, ec);
    --excess;
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.path = final_dir;
  stats_.write_ms = ms_since(t0);
  stats_.bytes = bytes;
}

std::vector<std::string> list_checkpoints(const std::string& run_dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run_dir, ec)) {
    const int64_t step = step_of(e.path().filename().string());
    if (step >= 0 && e.is_directory()) found.emplace_back(step, e.path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [step, path] : found) out.push_back(path);
  return out;
}

std::string resolve_checkpoint(const std::string& path) {
  if (fs::is_regular_file(path + "/" + kStateFile)) return path;
  const std::string latest = path + "/" + kLatest;
  if (!fs::is_regular_file(latest)) {
    if (!fs::is_directory(path))
      throw std::runtime_error(fmt::format("{}: no such checkpoint or run directory", path));
    throw std::runtime_error(
        fmt::format("{}: not a checkpoint (no {}) and no '{}' pointer", path, kStateFile, kLatest));
  }
  std::string name = read_file(latest);
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
  if (step_of(name) < 0)
    throw std::runtime_error(fmt::format("{}: does not name a ckpt-<step> directory", latest));
  const std::string dir = path + "/" + name;
  if (fs::is_directory(dir)) return dir;
  // Only possible if a save replacing a same-step checkpoint was killed between its renames:
  // the newest complete checkpoint is then the one to resume.
  const auto all = list_checkpoints(path);
  if (all.empty())
    throw std::runtime_error(fmt::format("{}: names {}, which does not exist", latest, name));
  return all.back();
}

Checkpoint read_checkpoint(const std::string& dir) {
  const std::string state_path = dir + "/" + kStateFile;
  if (!fs::is_regular_file(state_path))
    throw std::runtime_error(fmt::format("{}: missing (not a checkpoint directory)", state_path));
  nlohmann::json st;
  try {
    st = nlohmann::json::parse(read_file(state_path));
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(fmt::format("{}: not valid JSON: {}", state_path, e.what()));
  }
  Checkpoint c;
  c.path = dir;
  try {
    if (st.at("format") != "kuai-checkpoint")
      throw std::runtime_error(fmt::format("{}: format is not kuai-checkpoint", state_path));
    if (st.at("version").get<int>() != kStateVersion)
      throw std::runtime_error(fmt::format("{}: version {} is not {}", state_path,
                                           st.at("version").dump(), kStateVersion));
    c.state.step = st.at("step").get<int64_t>();
    c.optimizer_steps = st.at("optimizer_steps").get<int64_t>();
    c.state.loader.next_index = st.at("loader").at("next_index").get<int64_t>();
    c.state.data_seed = st.at("data_seed").get<uint64_t>();
    if (const auto& ls = st.at("loss_scale"); !ls.is_null()) {
      amp::GradScalerState g{ls.at("scale").get<float>(), ls.at("growth_tracker").get<int64_t>()};
      if (!std::isfinite(g.scale) || g.scale <= 0.0f || g.growth_tracker < 0)
        throw std::runtime_error(
            fmt::format("{}: loss_scale {} is not a positive finite scale", state_path, ls.dump()));
      c.state.loss_scale = g;
    }
    if (c.state.step < 0 || c.optimizer_steps < 0 || c.state.loader.next_index < 0)
      throw std::runtime_error(fmt::format("{}: negative step or position", state_path));
    for (const char* f : {kModelFile, kOptimFile, kConfigFile}) {
      const auto& entry = st.at("files").at(f);
      const std::string path = dir + "/" + f;
      if (!fs::is_regular_file(path)) throw std::runtime_error(fmt::format("{}: missing", path));
      const std::string content = read_file(path);
      const auto want = entry.at("bytes").get<uint64_t>();
      if (content.size() != want)
        throw std::runtime_error(
            fmt::format("{}: size check failed: {} bytes, expected {} "
                        "(truncated or replaced)",
                        path, content.size(), want));
      if (io::xxh3_hex(content.data(), content.size()) != entry.at("xxh3").get<std::string>())
        throw std::runtime_error(fmt::format("{}: checksum mismatch (xxh3 {} expected {})", path,
                                             io::xxh3_hex(content.data(), content.size()),
                                             entry.at("xxh3").get<std::string>()));
      if (std::string(f) == kConfigFile) c.state.config_toml = content;
    }
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(
        fmt::format("{}: missing or malformed field: {}", state_path, e.what()));
  }
  return c;
}

void restore_checkpoint(const Checkpoint& c, nn::GPT& model, optim::AdamW& opt) {
  const io::SafetensorsFile mf = io::SafetensorsFile::open(c.path + "/" + kModelFile);
  const auto params = model.named_parameters();
  if (mf.entries().size() != params.size())
    throw std::runtime_error(fmt::format("{}: {} tensors, the model has {}", mf.path(),
                                         mf.entries().size(), params.size()));
  for (const auto& [name, p] : params) load_entry(mf, name, p);
  const io::SafetensorsFile of = io::SafetensorsFile::open(c.path + "/" + kOptimFile);
  opt.ensure_state();
  const auto names = optimizer_names(model, opt);
  size_t expected = 0;
  for (size_t g = 0; g < names.size(); ++g)
    for (size_t i = 0; i < names[g].size(); ++i) {
      load_entry(of, "exp_avg." + names[g][i], opt.exp_avg()[g][i]);
      load_entry(of, "exp_avg_sq." + names[g][i], opt.exp_avg_sq()[g][i]);
      expected += 2;
    }
  if (of.entries().size() != expected)
    throw std::runtime_error(fmt::format("{}: {} tensors, the optimizer has {}", of.path(),
                                         of.entries().size(), expected));
  opt.set_step_count(c.optimizer_steps);
}

}  // namespace kuai::train

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
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "kuai/core/device.h"
#include "kuai/core/ops.h"
#include "kuai/core/primitives.h"
#include "kuai/core/version.h"
#include "kuai/distributed/process_group.h"
#include "kuai/distributed/zero.h"
#include "kuai/io/checksum.h"
#include "kuai/io/safetensors.h"
#include "kuai/train/config.h"

namespace kuai::train {

namespace fs = std::filesystem;

namespace {

constexpr int kStateVersion = 1;
constexpr char kModelFile[] = "model.safetensors";
std::string optim_file(int rank) { return fmt::format("optimizer.rank{}.safetensors", rank); }
std::string model_shard_file(int rank) { return fmt::format("model.rank{}.safetensors", rank); }
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
  c.copy_to_host(b.bytes.data(), n);
}

void write_blobs(const std::string& path, const std::vector<Blob>& blobs, const std::string& kind) {
  std::vector<io::SafetensorsView> views;
  views.reserve(blobs.size());
  for (const Blob& b : blobs)
    views.push_back(
        {b.name, "F32", b.shape, b.bytes.data(), static_cast<uint64_t>(b.bytes.size())});
  io::write_safetensors(path, views, {{"kuai.format", kind}, {"kuai.version", kKuaiVersion}});
}

// Parameter -> its name in the model, through the identity of the tensors.
std::map<const void*, std::string> names_by_impl(const nn::GPT& model) {
  std::map<const void*, std::string> by_impl;
  for (const auto& [name, p] : model.named_parameters()) by_impl[p.impl()] = name;
  return by_impl;
}

// (group, index) -> parameter name.
std::vector<std::vector<std::string>> optimizer_names(const nn::GPT& model,
                                                      const optim::Optimizer& opt) {
  const auto by_impl = names_by_impl(model);
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

std::string piece_name(const char* kind, const OptimizerPiece& p) {
  return p.whole ? fmt::format("{}.{}", kind, p.param)
                 : fmt::format("{}.{}@{}", kind, p.param, p.begin);
}

}  // namespace

OptimizerShard optimizer_shard(const nn::GPT& model, optim::AdamW& opt) {
  opt.ensure_state();
  const auto names = optimizer_names(model, opt);
  OptimizerShard out{&opt, nullptr, {}};
  for (size_t g = 0; g < names.size(); ++g)
    for (size_t i = 0; i < names[g].size(); ++i) {
      const Tensor& m = opt.exp_avg()[g][i];
      out.pieces.push_back({names[g][i], 0, true, m.shape(), m, opt.exp_avg_sq()[g][i]});
    }
  return out;
}

OptimizerShard optimizer_shard(const nn::GPT& model, optim::OffloadedAdamW& opt) {
  const auto names = optimizer_names(model, opt);
  OptimizerShard out{&opt, &opt.moments(), {}};
  for (const optim::OffloadedAdamW::Slot& s : opt.layout()) {
    const Tensor& p = opt.groups()[s.group].params[s.index];
    out.pieces.push_back({names[s.group][s.index], 0, true, p.shape(), {}, {}, s.first, s.master});
  }
  out.masters = opt.has_masters();
  return out;
}

OptimizerShard optimizer_shard(const nn::GPT& model, dist::ZeroAdamW& opt) {
  const auto by_impl = names_by_impl(model);
  OptimizerShard out{&opt, opt.offloaded(), {}};
  out.masters = opt.has_masters();
  auto name_of = [&](const dist::ZeroAdamW::Segment& s) {
    auto it = by_impl.find(opt.groups()[s.group].params[s.param].impl());
    if (it == by_impl.end())
      throw std::invalid_argument("checkpoint: an optimizer parameter is not in the model");
    return it->second;
  };
  if (out.masters && opt.process_group()->size() > 1) out.zero_masters = &opt;
  out.sharded_model = opt.stage() == 3;
  for (const dist::ZeroAdamW::Segment& s : opt.segments()) {
    const Tensor& p = opt.groups()[s.group].params[s.param];
    const std::string name = name_of(s);
    const bool whole = s.begin == 0 && s.length == p.numel();
    const Shape shape = whole ? p.shape() : Shape{s.length};
    Tensor values;  // ZeRO-3: this piece of the parameter shard
    if (out.sharded_model)
      values = reshape(narrow(opt.parameter_shard(), 0, s.shard_offset, s.length), shape);
    if (opt.offloaded()) {
      out.pieces.push_back({name,
                            s.begin,
                            whole,
                            shape,
                            {},
                            {},
                            s.shard_offset,
                            opt.is_master(s.group, s.param),
                            values});
      continue;
    }
    const Tensor m = narrow(opt.exp_avg(), 0, s.shard_offset, s.length);
    const Tensor v = narrow(opt.exp_avg_sq(), 0, s.shard_offset, s.length);
    out.pieces.push_back(
        {name, s.begin, whole, shape, reshape(m, shape), reshape(v, shape), -1, false, values});
  }
  return out;
}

struct Checkpointer::Snapshot {
  TrainingState state;
  int64_t optimizer_steps = 0;
  std::vector<Blob> model, optim;
  std::optional<FileRecord> streamed;        // the offloaded optimizer file, already written
  std::optional<FileRecord> streamed_model;  // the model file, streamed with it (masters)
  std::vector<FileRecord> written;           // by this rank, with sizes and checksums
  bool sharded_model = false;                // `model` holds this rank's model shard
};

Checkpointer::Checkpointer(std::string run_dir, int64_t keep_last, bool async,
                           std::shared_ptr<dist::ProcessGroup> group)
    : run_dir_(std::move(run_dir)),
      keep_last_(std::max<int64_t>(1, keep_last)),
      async_(async),
      group_(group && group->size() > 1 ? std::move(group) : nullptr) {
  std::error_code ec;
  fs::create_directories(run_dir_, ec);
  if (ec) throw std::runtime_error(fmt::format("{}: cannot create: {}", run_dir_, ec.message()));
  // Leftovers of a save that was killed: never valid, never pointed to. With a group, rank 0
  // removes them before any rank writes.
  if (!group_ || group_->rank() == 0)
    for (const auto& e : fs::directory_iterator(run_dir_)) {
      const std::string n = e.path().filename().string();
      if (n.rfind("ckpt-", 0) == 0 && (n.ends_with(".tmp") || n.ends_with(".old")))
        fs::remove_all(e.path(), ec);
    }
  if (group_) group_->barrier();
  if (async_) thread_ = std::thread([this] { writer_main(); });
}

std::string Checkpointer::optimizer_file() const { return optim_file(group_ ? group_->rank() : 0); }

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
  return save(model, optimizer_shard(model, opt), state);
}

double Checkpointer::save(const nn::GPT& model, const OptimizerShard& opt,
                          const TrainingState& state) {
  const auto t0 = Clock::now();
  wait();  // at most one save in flight; a failed previous save surfaces here
  std::unique_ptr<Snapshot> snap;
  {
    std::lock_guard<std::mutex> lock(mu_);
    snap = std::move(spare_);  // the previous save's buffers, written and idle
  }
  if (!snap) snap = std::make_unique<Snapshot>();
  snap->state = state;
  snap->optimizer_steps = opt.optimizer->step_count();
  const bool writes_model = !group_ || group_->rank() == 0;
  snap->sharded_model = opt.sharded_model;
  if (opt.sharded_model) {  // this rank's pieces of the parameters, from the parameter shard
    snap->model.resize(opt.pieces.size());
    for (size_t i = 0; i < opt.pieces.size(); ++i) {
      const OptimizerPiece& p = opt.pieces[i];
      copy_into(snap->model[i], p.whole ? p.param : fmt::format("{}@{}", p.param, p.begin),
                p.values);
    }
  } else if (writes_model && !opt.masters) {
    const auto params = model.named_parameters();
    snap->model.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i)
      copy_into(snap->model[i], params[i].first, params[i].second);
  }
  snap->streamed.reset();
  snap->streamed_model.reset();
  if (opt.offloaded) {  // streamed from the files now: the next update rewrites them
    snap->optim.clear();
    try {
      snap->streamed =
          stream_optimizer(opt, state.step, opt.masters ? &model : nullptr, &snap->streamed_model);
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        snap->written.clear();
        spare_ = std::move(snap);
        if (group_) error_ = std::current_exception();
      }
      if (!group_) throw;
      // A group: the commit (a collective every rank runs) reports this rank's failure to all.
      uncommitted_ = true;
      if (!async_) commit();
      return ms_since(t0);
    }
  } else {
    snap->optim.resize(2 * opt.pieces.size());
    size_t j = 0;
    for (const OptimizerPiece& p : opt.pieces) {
      copy_into(snap->optim[j++], piece_name("exp_avg", p), p.exp_avg);
      copy_into(snap->optim[j++], piece_name("exp_avg_sq", p), p.exp_avg_sq);
    }
  }
  const double blocked = ms_since(t0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.blocked_ms = blocked;
  }
  if (!async_) {
    std::exception_ptr err;
    try {
      write(*snap);
    } catch (...) {
      err = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      spare_ = std::move(snap);
      error_ = err;
    }
    if (group_) {
      uncommitted_ = true;
      commit();  // every rank saves at the same step: commit now
    } else if (err) {
      wait();  // rethrows
    }
    return ms_since(t0);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_ = std::move(snap);
    busy_ = true;
  }
  if (group_) uncommitted_ = true;
  cv_.notify_all();
  return blocked;
}

void Checkpointer::wait() {
  if (group_)
    commit();
  else
    wait_writer();
}

void Checkpointer::wait_writer() {
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

void Checkpointer::write(Snapshot& s) {
  const auto t0 = Clock::now();
  write_files(s);
  if (!group_) put_in_place(s, s.written);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.write_ms = ms_since(t0);  // with a group: this rank's files (the commit comes later)
}

std::string Checkpointer::tmp_dir(int64_t step) const {
  return fmt::format("{}/ckpt-{}.tmp", run_dir_, step);
}

void Checkpointer::make_tmp_dir(int64_t step) const {
  const std::string tmp = tmp_dir(step);
  std::error_code ec;
  if (!group_) {
    fs::remove_all(tmp, ec);
    if (!fs::create_directory(tmp, ec) || ec)
      throw std::runtime_error(fmt::format("{}: cannot create: {}", tmp, ec.message()));
  } else {  // every rank writes into it; rank 0 removed stale ones at start
    fs::create_directories(tmp, ec);
    if (ec) throw std::runtime_error(fmt::format("{}: cannot create: {}", tmp, ec.message()));
  }
}

Checkpointer::FileRecord Checkpointer::stream_optimizer(const OptimizerShard& opt, int64_t step,
                                                        const nn::GPT* model,
                                                        std::optional<FileRecord>* model_record) {
  // ZeRO with masters: rank 0 gathers every rank's masters (dist::MasterGather) as the ranks
  // stream, and writes them into the model file; a rank that fails still takes part in the
  // remaining rounds, so none waits for it, and the failure is reported at the commit.
  const bool writes_model =
      model && (!opt.zero_masters || opt.zero_masters->process_group()->rank() == 0);
  std::optional<dist::MasterGather> gather;
  if (model && opt.zero_masters) gather.emplace(*opt.zero_masters);
  std::optional<io::SafetensorsWriter> model_file;
  std::map<const TensorImpl*, size_t> model_index;  // of each parameter's tensor in the file
  std::map<std::string, size_t> index_by_name;
  const dist::ZeroAdamW::MasterFn into_model = [&](const Tensor& p, int64_t begin, int64_t count,
                                                   const float* values) {
    if (model_file)
      model_file->write(model_index.at(p.impl()), uint64_t(begin) * 4, values, uint64_t(count) * 4);
  };
  const std::string path = tmp_dir(step) + "/" + optimizer_file();
  const std::string model_path = tmp_dir(step) + "/" + kModelFile;
  try {
    make_tmp_dir(step);
    // The in-memory save's layout (each piece's exp_avg, then its exp_avg_sq), so the file is the
    // same byte for byte; each piece's elements land where the chunk holding them passes (pieces
    // are in the order of the flat moments).
    std::vector<io::SafetensorsView> views;
    for (const OptimizerPiece& p : opt.pieces) {
      int64_t n = 1;
      for (int64_t d : p.shape) n *= d;
      for (const char* kind : {"exp_avg", "exp_avg_sq"})
        views.push_back({piece_name(kind, p), "F32", p.shape, nullptr, uint64_t(n) * 4});
    }
    io::SafetensorsWriter file(
        path, views, {{"kuai.format", "checkpoint-optimizer"}, {"kuai.version", kKuaiVersion}});
    // Masters offloaded: the model file as write_blobs lays it out (named_parameters order), the
    // parameters kept in fp32 written now, the masters' values as their chunks pass.
    if (writes_model) {
      const auto params = model->named_parameters();
      std::vector<io::SafetensorsView> mv;
      for (size_t i = 0; i < params.size(); ++i) {
        const Tensor& t = params[i].second;
        mv.push_back({params[i].first, "F32", t.shape(), nullptr, uint64_t(t.numel()) * 4});
        model_index[t.impl()] = i;
        index_by_name[params[i].first] = i;
      }
      model_file.emplace(model_path, mv,
                         std::map<std::string, std::string>{{"kuai.format", "checkpoint-model"},
                                                            {"kuai.version", kKuaiVersion}});
      for (size_t i = 0; i < params.size(); ++i)
        if (!params[i].second.impl()->master_elsewhere) {
          const Tensor c = params[i].second.contiguous();
          model_file->write(i, 0, c.device_data<float>(), uint64_t(c.numel()) * 4);
        }
    }
    const size_t np = opt.pieces.size();
    size_t p0 = 0;
    opt.offloaded->read([&](const optim::StateChunk& c) {
      const int64_t lo = c.first, hi = c.first + c.count;
      while (p0 < np && opt.pieces[p0].first + int64_t(views[2 * p0].nbytes / 4) <= lo) ++p0;
      for (size_t i = p0; i < np && opt.pieces[i].first < hi; ++i) {
        const int64_t first = opt.pieces[i].first, n = int64_t(views[2 * i].nbytes / 4);
        const int64_t a = std::max(lo, first), b = std::min(hi, first + n);
        if (a >= b) continue;
        const uint64_t at = uint64_t(a - first) * 4, bytes = uint64_t(b - a) * 4;
        file.write(2 * i, at, c.exp_avg + (a - lo), bytes);
        file.write(2 * i + 1, at, c.exp_avg_sq + (a - lo), bytes);
        if (model_file && !gather && opt.pieces[i].master)
          model_file->write(index_by_name.at(opt.pieces[i].param),
                            uint64_t(opt.pieces[i].begin + (a - first)) * 4, c.master + (a - lo),
                            bytes);
      }
      if (gather) gather->round(c.master, c.first, c.count, into_model);
    });
    file.finish();
    if (model_file) {
      model_file->finish();
      const io::FileDigest d = io::file_xxh3(model_path);
      *model_record = FileRecord{kModelFile, d.bytes, d.xxh3};
    }
  } catch (...) {
    model_file.reset();  // abandoned: nothing more is written into it
    if (gather) gather->finish();
    throw;
  }
  const io::FileDigest d = io::file_xxh3(path);  // what is on disk now
  return {optimizer_file(), d.bytes, d.xxh3};
}

void Checkpointer::write_files(Snapshot& s) {
  s.written.clear();
  const std::string tmp = tmp_dir(s.state.step);
  if (!s.streamed) make_tmp_dir(s.state.step);  // else made (and written into) by save()
  std::vector<std::string> files;
  if (!group_ || group_->rank() == 0) {
    if (s.streamed_model) {
      s.written.push_back(*s.streamed_model);
    } else if (!s.sharded_model) {
      write_blobs(tmp + "/" + kModelFile, s.model, "checkpoint-model");
      files.push_back(kModelFile);
    }
    write_file_synced(tmp + "/" + kConfigFile, s.state.config_toml.data(),
                      s.state.config_toml.size());
    files.push_back(kConfigFile);
  }
  if (s.sharded_model) {
    const std::string f = model_shard_file(group_ ? group_->rank() : 0);
    write_blobs(tmp + "/" + f, s.model, "checkpoint-model-shard");
    files.push_back(f);
  }
  if (!s.streamed) {
    write_blobs(tmp + "/" + optimizer_file(), s.optim, "checkpoint-optimizer");
    files.push_back(optimizer_file());
  }
  for (const std::string& f : files) {
    const io::FileDigest d = io::file_xxh3(tmp + "/" + f);  // what is on disk now
    s.written.push_back({f, d.bytes, d.xxh3});
  }
  if (s.streamed) s.written.push_back(*s.streamed);
  fsync_dir(tmp);
  // A fault-injection point (tests/multihost/faults.sh): KUAI_FAULT_SAVE_STALL_S=<seconds> holds
  // every save between writing its files and putting the checkpoint in place, so that a test can
  // end a rank while `ckpt-<step>.tmp` is there, as a slow file system would leave it.
  if (const char* stall = std::getenv("KUAI_FAULT_SAVE_STALL_S"); stall != nullptr)
    std::this_thread::sleep_for(std::chrono::duration<double>(std::atof(stall)));
}

void Checkpointer::put_in_place(const Snapshot& s, const std::vector<FileRecord>& files) {
  const std::string name = fmt::format("ckpt-{}", s.state.step);
  const std::string final_dir = run_dir_ + "/" + name, tmp = final_dir + ".tmp";
  std::error_code ec;
  nlohmann::json st = {{"format", "kuai-checkpoint"},
                       {"version", kStateVersion},
                       {"kuai_version", kKuaiVersion},
                       {"step", s.state.step},
                       {"optimizer_steps", s.optimizer_steps},
                       {"loader", {{"next_index", s.state.loader.next_index}}},
                       {"data_seed", s.state.data_seed},
                       {"loss_scale", nullptr},  // fp32 and bf16: no scaler
                       {"world_size", group_ ? group_->size() : 1},
                       {"ranks", s.state.ranks},
                       {"sharded_model", s.sharded_model}};
  if (s.state.loss_scale)
    st["loss_scale"] = {{"scale", s.state.loss_scale->scale},
                        {"growth_tracker", s.state.loss_scale->growth_tracker}};
  int64_t bytes = 0;
  for (const FileRecord& f : files) {
    st["files"][f.name] = {{"bytes", f.bytes}, {"xxh3", io::xxh3_hex(f.xxh3)}};
    bytes += static_cast<int64_t>(f.bytes);
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
    // Renamed away first (one atomic step), so that a reader without the lock finds a checkpoint
    // whole or not at all; the Checkpointer's constructor removes a .old a kill left behind.
    const std::string doomed = dir + ".old";
    fs::remove_all(doomed, ec);
    fs::rename(dir, doomed, ec);
    fs::remove_all(ec ? dir : doomed, ec);
    --excess;
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.path = final_dir;
  stats_.bytes = bytes;
}

void Checkpointer::commit() {
  if (!group_ || !uncommitted_) return;
  uncommitted_ = false;
  std::string own_error;
  try {
    wait_writer();
  } catch (const std::exception& e) {
    own_error = e.what();
  }
  const Snapshot* s = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = spare_.get();  // the snapshot just written
  }
  const int world = group_->size(), rank = group_->rank();
  // Every rank's files of its own: (written, optimizer file's bytes and xxh3, model shard's bytes
  // and xxh3 (ZeRO-3, else 0)). Host tensors: the process group exchanges them in host memory.
  constexpr int kRec = 5;
  Tensor mine = zeros({kRec}, DType::kI64), all = zeros({kRec * world}, DType::kI64);
  auto record = [&](const std::string& name) -> const FileRecord* {
    for (const FileRecord& f : s->written)
      if (f.name == name) return &f;
    return nullptr;
  };
  const bool sharded_model = s != nullptr && s->sharded_model;
  if (own_error.empty() && s != nullptr) {
    const FileRecord* o = record(optimizer_file());
    const FileRecord* m = sharded_model ? record(model_shard_file(rank)) : nullptr;
    if (o != nullptr && (m != nullptr || !sharded_model)) {
      int64_t* v = mine.data<int64_t>();
      v[0] = 1;
      v[1] = static_cast<int64_t>(o->bytes);
      v[2] = static_cast<int64_t>(o->xxh3);
      v[3] = m != nullptr ? static_cast<int64_t>(m->bytes) : 0;
      v[4] = m != nullptr ? static_cast<int64_t>(m->xxh3) : 0;
    }
  }
  group_->all_gather(mine, all)->wait();
  const int64_t* rec = all.data<int64_t>();
  int failed = -1;
  for (int r = 0; r < world && failed < 0; ++r)
    if (rec[kRec * r] != 1) failed = r;
  Tensor status = zeros({1}, DType::kI64);
  std::string commit_error;
  if (rank == 0 && failed < 0) {
    std::vector<FileRecord> files;  // rank 0's shared ones (the config, a whole model) first
    for (const FileRecord& f : s->written)
      if (f.name != optimizer_file() && f.name != model_shard_file(0)) files.push_back(f);
    for (int r = 0; r < world; ++r) {
      const int64_t* v = rec + kRec * r;
      files.push_back({optim_file(r), static_cast<uint64_t>(v[1]), static_cast<uint64_t>(v[2])});
      if (sharded_model)
        files.push_back(
            {model_shard_file(r), static_cast<uint64_t>(v[3]), static_cast<uint64_t>(v[4])});
    }
    try {
      put_in_place(*s, files);
      status.data<int64_t>()[0] = 1;
    } catch (const std::exception& e) {
      commit_error = e.what();
    }
  }
  group_->broadcast(status, 0)->wait();
  if (!own_error.empty()) throw std::runtime_error(own_error);
  if (status.data<int64_t>()[0] == 1) return;
  if (!commit_error.empty()) throw std::runtime_error(commit_error);
  const int64_t step = s != nullptr ? s->state.step : -1;
  if (failed >= 0)
    throw std::runtime_error(fmt::format(
        "{}/ckpt-{}: rank {} could not write its shard (its message says why); the previous "
        "checkpoint stays in place",
        run_dir_, step, failed));
  throw std::runtime_error(fmt::format(
      "{}/ckpt-{}: rank 0 could not put the checkpoint in place (its message says why); the "
      "previous checkpoint stays in place",
      run_dir_, step));
}

int64_t checkpoint_step_of(const std::string& name) {
  if (name.rfind("ckpt-", 0) != 0 || name.size() <= 5) return -1;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || v > (int64_t{1} << 50)) return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

std::vector<std::string> list_checkpoints(const std::string& run_dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run_dir, ec)) {
    const int64_t step = checkpoint_step_of(e.path().filename().string());
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
  if (checkpoint_step_of(name) < 0)
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
    c.world_size = st.contains("world_size") ? st.at("world_size").get<int64_t>() : 1;
    if (c.world_size < 1 || c.world_size > (1 << 20))
      throw std::runtime_error(
          fmt::format("{}: world_size {} is not a number of ranks", state_path, c.world_size));
    c.state.ranks = st.contains("ranks") ? st.at("ranks").get<int64_t>() : c.world_size;
    if (c.state.ranks < 1 || c.state.ranks > (1 << 20))
      throw std::runtime_error(
          fmt::format("{}: ranks {} is not a number of ranks", state_path, c.state.ranks));
    c.sharded_model = st.contains("sharded_model") && st.at("sharded_model").get<bool>();
    std::vector<std::string> files = {kConfigFile};
    if (!c.sharded_model) files.push_back(kModelFile);
    for (int64_t r = 0; r < c.world_size; ++r) {
      files.push_back(optim_file(static_cast<int>(r)));
      if (c.sharded_model) files.push_back(model_shard_file(static_cast<int>(r)));
    }
    for (const std::string& f : files) {
      const auto& entry = st.at("files").at(f);
      const std::string path = dir + "/" + f;
      if (!fs::is_regular_file(path)) throw std::runtime_error(fmt::format("{}: missing", path));
      const io::FileDigest d = io::file_xxh3(path);  // in blocks: files larger than memory too
      const auto want = entry.at("bytes").get<uint64_t>();
      if (d.bytes != want)
        throw std::runtime_error(
            fmt::format("{}: size check failed: {} bytes, expected {} "
                        "(truncated or replaced)",
                        path, d.bytes, want));
      if (io::xxh3_hex(d.xxh3) != entry.at("xxh3").get<std::string>())
        throw std::runtime_error(fmt::format("{}: checksum mismatch (xxh3 {} expected {})", path,
                                             io::xxh3_hex(d.xxh3),
                                             entry.at("xxh3").get<std::string>()));
      if (f == kConfigFile) c.state.config_toml = read_file(path);
    }
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(
        fmt::format("{}: missing or malformed field: {}", state_path, e.what()));
  }
  return c;
}

void restore_checkpoint(const Checkpoint& c, nn::GPT& model, optim::AdamW& opt) {
  restore_checkpoint(c, model, optimizer_shard(model, opt));
}

namespace {

// Where the stored elements of one parameter's values ("param") or moment ("exp_avg",
// "exp_avg_sq") are: whole tensors, or 1-D pieces "<...>@<first element>", in any files.
struct Source {
  int64_t begin, length;
  const io::SafetensorsFile* file;
  const io::SafetensorsEntry* entry;
};
struct Stored {
  std::string dir;                         // the checkpoint, for messages
  std::vector<io::SafetensorsFile> files;  // kept open: the sources point into them
  std::map<std::pair<std::string, std::string>, std::vector<Source>> by_key;  // (kind, param)
};

// Indexes every tensor of `f` (a model file or shard: "<name>[@b]"; an optimizer file:
// "exp_avg.<name>[@b]", "exp_avg_sq.<name>[@b]"), each checked against the model's parameters.
void index_file(Stored& st, const io::SafetensorsFile& f, bool model_file,
                const std::map<std::string, Tensor>& by_name) {
  for (const io::SafetensorsEntry& e : f.entries()) {
    std::string kind, rest;
    if (model_file) {
      kind = "param";
      rest = e.name;
    } else {
      for (const char* k : {"exp_avg_sq.", "exp_avg."})
        if (e.name.rfind(k, 0) == 0) {
          kind = std::string(k, std::strlen(k) - 1);
          rest = e.name.substr(std::strlen(k));
          break;
        }
    }
    const size_t at = rest.rfind('@');
    const std::string param = at == std::string::npos ? rest : rest.substr(0, at);
    auto it = by_name.find(param);
    if (kind.empty() || it == by_name.end())
      throw std::runtime_error(fmt::format("{}: tensor '{}' is not {} of a parameter of this model",
                                           f.path(), e.name,
                                           model_file ? "the values" : "the state"));
    if (e.dtype != "F32")
      throw std::runtime_error(
          fmt::format("{}: tensor '{}' has dtype {}, expected F32", f.path(), e.name, e.dtype));
    const int64_t numel = it->second.numel();
    Source src{0, numel, &f, &e};
    if (at == std::string::npos) {
      if (e.shape != it->second.shape())
        throw std::runtime_error(fmt::format("{}: tensor '{}' has shape {}, expected {}", f.path(),
                                             e.name, shape_str(e.shape),
                                             shape_str(it->second.shape())));
    } else {
      const std::string digits = rest.substr(at + 1);
      const bool number =
          !digits.empty() && digits.size() <= 15 &&
          std::all_of(digits.begin(), digits.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
      src.begin = number ? std::stoll(digits) : -1;
      src.length = e.shape.size() == 1 ? e.shape[0] : -1;
      if (src.begin < 0 || src.length < 0 || src.begin + src.length > numel)
        throw std::runtime_error(
            fmt::format("{}: tensor '{}' of shape {} is not a piece of {} ({} elements)", f.path(),
                        e.name, shape_str(e.shape), param, numel));
    }
    st.by_key[{kind, param}].push_back(src);
  }
}

// The model files of checkpoint `c` (the whole one, or every rank's shard) and, with `optimizer`,
// its optimizer files, indexed; no element stored twice.
std::unique_ptr<Stored> read_stored(const Checkpoint& c, const nn::GPT& model, bool optimizer) {
  auto st = std::make_unique<Stored>();
  st->dir = c.path;
  const auto params = model.named_parameters();
  const std::map<std::string, Tensor> by_name(params.begin(), params.end());
  std::vector<std::pair<std::string, bool>> names;  // (file, holds model values)
  if (!c.sharded_model) names.emplace_back(kModelFile, true);
  for (int64_t r = 0; r < c.world_size; ++r) {
    if (c.sharded_model) names.emplace_back(model_shard_file(static_cast<int>(r)), true);
    if (optimizer) names.emplace_back(optim_file(static_cast<int>(r)), false);
  }
  st->files.reserve(names.size());
  for (const auto& [name, values] : names) {
    st->files.push_back(io::SafetensorsFile::open(c.path + "/" + name));
    index_file(*st, st->files.back(), values, by_name);
  }
  for (auto& [key, sources] : st->by_key) {
    std::sort(sources.begin(), sources.end(),
              [](const Source& a, const Source& b) { return a.begin < b.begin; });
    for (size_t i = 1; i < sources.size(); ++i)
      if (sources[i].begin < sources[i - 1].begin + sources[i - 1].length)
        throw std::runtime_error(fmt::format("{}: {} of {} is stored twice ({} and {})", c.path,
                                             key.first, key.second, sources[i - 1].file->path(),
                                             sources[i].file->path()));
  }
  return st;
}

// Elements [b, e) of one kind of one parameter from whichever stored pieces overlap them:
// put(lo, hi, bytes) for each stored run; returns how many elements were found.
int64_t copy_range(const Stored& st, const std::string& kind, const std::string& param, int64_t b,
                   int64_t e, const std::function<void(int64_t, int64_t, const std::byte*)>& put) {
  int64_t covered = 0;
  auto it = st.by_key.find({kind, param});
  if (it == st.by_key.end()) return 0;
  for (const Source& src : it->second) {
    const int64_t lo = std::max(b, src.begin), hi = std::min(e, src.begin + src.length);
    if (lo >= hi) continue;
    put(lo, hi,
        src.file->data(*src.entry).data() + static_cast<size_t>(lo - src.begin) * sizeof(float));
    covered += hi - lo;
  }
  return covered;
}

std::runtime_error missing_error(const Checkpoint& c, const std::string& kind,
                                 const std::string& param, int64_t b, int64_t e) {
  const bool values = kind == "param";
  const std::string where =
      values ? (c.sharded_model ? fmt::format("its {} model shard file{}", c.world_size,
                                              c.world_size > 1 ? "s" : "")
                                : std::string("its model file"))
             : fmt::format("its {} optimizer file{}", c.world_size, c.world_size > 1 ? "s" : "");
  return std::runtime_error(fmt::format("{}: {} of {}, elements [{}, {}), is missing from {}",
                                        c.path, values ? "the values" : kind, param, b, e, where));
}

// Elements [b, e) of one kind of one parameter into the fp32 host memory at `dst`, all present.
void restore_range(const Checkpoint& c, const Stored& st, const std::string& kind,
                   const std::string& param, int64_t b, int64_t e, float* dst) {
  const int64_t covered =
      copy_range(st, kind, param, b, e, [&](int64_t lo, int64_t hi, const std::byte* bytes) {
        std::memcpy(dst + (lo - b), bytes, static_cast<size_t>(hi - lo) * sizeof(float));
      });
  if (covered != e - b) throw missing_error(c, kind, param, b, e);
}

// Elements [b, e) into the contiguous fp32 tensor `dst` (dst.numel() == e - b).
void restore_tensor(const Checkpoint& c, const Stored& st, const std::string& kind,
                    const std::string& param, int64_t b, const Tensor& dst) {
  if (!dst.is_contiguous() || dst.dtype() != DType::kF32)
    throw std::invalid_argument("checkpoint: a restored tensor is not contiguous fp32");
  const int64_t e = b + dst.numel();
  const int64_t covered =
      copy_range(st, kind, param, b, e, [&](int64_t lo, int64_t hi, const std::byte* bytes) {
        Tensor::view_of(dst, {hi - lo}, {1}, dst.offset() + (lo - b))
            .copy_from_host(bytes, static_cast<size_t>(hi - lo) * sizeof(float));
      });
  if (covered != e - b) throw missing_error(c, kind, param, b, e);
}

// Every parameter of `model` whole from the stored values; a working copy whose master is
// offloaded gets the master's cast (its fp32 values go to the masters file in the optimizer's
// restore).
void load_model(const Checkpoint& c, const Stored& st, nn::GPT& model) {
  for (const auto& [name, p] : model.named_parameters()) {
    if (!p.impl()->master_elsewhere) {
      restore_tensor(c, st, "param", name, 0, p);
      continue;
    }
    std::vector<float> master(static_cast<size_t>(p.numel()));
    restore_range(c, st, "param", name, 0, p.numel(), master.data());
    optim::cast_master_into_(master.data(), p, 0, p.numel());
  }
}

}  // namespace

void restore_model(const Checkpoint& c, nn::GPT& model) {
  load_model(c, *read_stored(c, model, false), model);
}

void read_model_stream(const Checkpoint& c, const nn::GPTConfig& cfg,
                       const std::function<void(const std::string&, const Tensor&)>& fn) {
  std::unique_ptr<nn::GPT> shapes;
  {
    const DeviceGuard meta(kMeta);  // names and shapes, no bytes
    shapes = std::make_unique<nn::GPT>(cfg, 0);
  }
  const std::unique_ptr<Stored> st = read_stored(c, *shapes, false);
  for (const auto& [name, p] : shapes->named_parameters()) {
    Tensor value = Tensor::empty(p.shape(), DType::kF32, kCPU);
    restore_tensor(c, *st, "param", name, 0, value);
    fn(name, value);
  }
}

CommittedModel read_latest_model(const std::string& run_dir, int attempts) {
  for (int attempt = 1;; ++attempt) {
    const std::string dir = resolve_checkpoint(run_dir);
    try {
      const Checkpoint c = read_checkpoint(dir);
      const TrainConfig cfg = load_config_text(c.state.config_toml, dir + "/" + kConfigFile);
      CommittedModel out;
      out.path = dir;
      out.step = c.state.step;
      out.model = std::make_unique<nn::GPT>(cfg.model, 0);
      restore_model(c, *out.model);
      return out;
    } catch (const std::exception&) {
      // Pruned under us (renamed away, then removed): the trainer has a newer one; read again.
      if (fs::exists(dir) || attempt >= attempts) throw;
    }
  }
}

void restore_checkpoint(const Checkpoint& c, nn::GPT& model, const OptimizerShard& opt) {
  const std::unique_ptr<Stored> stored = read_stored(c, model, true);
  const Stored& st = *stored;
  // The model: whole parameters, or (sharded) this rank's pieces of them into the shard.
  if (opt.sharded_model) {
    for (const OptimizerPiece& piece : opt.pieces)
      restore_tensor(c, st, "param", piece.param, piece.begin, piece.values);
  } else {
    load_model(c, st, model);
  }
  if (opt.offloaded) {
    // Offloaded: the pieces stream into fresh moment files, chunk by chunk in the flat order.
    std::vector<int64_t> numel(opt.pieces.size());
    for (size_t i = 0; i < opt.pieces.size(); ++i) {
      numel[i] = 1;
      for (int64_t d : opt.pieces[i].shape) numel[i] *= d;
    }
    size_t p0 = 0;
    opt.offloaded->write([&](const optim::StateChunk& ch) {
      const int64_t lo = ch.first, hi = ch.first + ch.count;
      while (p0 < numel.size() && opt.pieces[p0].first + numel[p0] <= lo) ++p0;
      for (size_t i = p0; i < numel.size() && opt.pieces[i].first < hi; ++i) {
        const OptimizerPiece& piece = opt.pieces[i];
        const int64_t a = std::max(lo, piece.first), b = std::min(hi, piece.first + numel[i]);
        if (a >= b) continue;
        const int64_t pb = piece.begin + (a - piece.first);  // of the parameter
        if (piece.master)  // the model's values (the working copy has their cast)
          restore_range(c, st, "param", piece.param, pb, pb + (b - a), ch.master + (a - lo));
        restore_range(c, st, "exp_avg", piece.param, pb, pb + (b - a), ch.exp_avg + (a - lo));
        restore_range(c, st, "exp_avg_sq", piece.param, pb, pb + (b - a), ch.exp_avg_sq + (a - lo));
      }
    });
  } else {
    // In memory: each piece of this optimizer from whichever stored pieces overlap it.
    for (const OptimizerPiece& piece : opt.pieces) {
      restore_tensor(c, st, "exp_avg", piece.param, piece.begin, piece.exp_avg);
      restore_tensor(c, st, "exp_avg_sq", piece.param, piece.begin, piece.exp_avg_sq);
    }
  }
  opt.optimizer->set_step_count(c.optimizer_steps);
}

}  // namespace kuai::train

// The disk's streamed bandwidth (see disk.h).
#include "kuai/plan/disk.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "kuai/io/chunk_stream.h"
#include "kuai/plan/cache_file.h"

namespace kuai::plan {

double Disk::seconds(double read, double written) const {
  if (read > 0 && written > 0 && update_gbs > 0) return (read + written) / (update_gbs * 1e9);
  double s = 0;
  if (read > 0) s += read / (std::max(read_gbs, 1e-9) * 1e9);
  if (written > 0) s += written / (std::max(write_gbs, 1e-9) * 1e9);
  return s;
}

namespace {

// One update pass without overlap: each chunk of each file read, then written back, in turn.
double serial_update_gbs(const std::vector<std::string>& paths, int64_t bytes, int64_t chunk) {
  std::vector<int> fds;
  for (const std::string& p : paths) {
    int fd = ::open(p.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
    if (fd < 0) fd = ::open(p.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) throw io::IoError(fmt::format("bench disk: {}: cannot open", p));
    fds.push_back(fd);
  }
  void* raw = nullptr;
  if (::posix_memalign(&raw, 4096, static_cast<size_t>(chunk) * paths.size()) != 0)
    throw std::bad_alloc();
  auto* buf = static_cast<char*>(raw);
  const auto t0 = std::chrono::steady_clock::now();
  bool ok = true;
  for (int64_t off = 0; off < bytes && ok; off += chunk) {
    const int64_t len = std::min(chunk, (bytes - off + 4095) / 4096 * 4096);
    for (size_t f = 0; f < fds.size(); ++f)
      ok = ok && ::pread(fds[f], buf + f * chunk, len, off) == len;
    for (size_t f = 0; f < fds.size(); ++f) std::memcpy(buf + f * chunk, &off, sizeof off);
    for (size_t f = 0; f < fds.size(); ++f)
      ok = ok && ::pwrite(fds[f], buf + f * chunk, len, off) == len;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::free(raw);
  for (int fd : fds) ::close(fd);
  if (!ok) throw io::IoError("bench disk: a serial read or write failed");
  return 2.0 * static_cast<double>(bytes) * static_cast<double>(paths.size()) / s / 1e9;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
}  // namespace

Disk measure_disk(const DiskBenchOptions& o) {
  namespace fs = std::filesystem;
  fs::create_directories(o.dir);
  std::vector<std::string> paths;
  for (int64_t f = 0; f < o.files; ++f)
    paths.push_back((fs::path(o.dir) / fmt::format("kuai_disk_bench_{}.bin", f)).string());
  io::StreamOptions so;
  so.chunk_bytes = o.chunk_bytes;
  std::vector<double> w, r, u, serial;
  {
    io::ChunkStream s(paths, o.bytes, so);
    const double total = static_cast<double>(o.bytes) * static_cast<double>(o.files);
    using Clock = std::chrono::steady_clock;
    auto secs = [](Clock::time_point t0) {
      return std::chrono::duration<double>(Clock::now() - t0).count();
    };
    // Values that change each pass (no file system can skip writing them).
    int64_t stamp = 0;
    auto touch = [&](int64_t, std::span<std::byte* const> bufs) {
      ++stamp;
      for (std::byte* b : bufs) std::memcpy(b, &stamp, sizeof stamp);
    };
    for (int64_t round = 0; round < o.rounds; ++round) {
      auto t0 = Clock::now();
      s.fill(touch);
      w.push_back(total / secs(t0) / 1e9);
      t0 = Clock::now();
      s.pass([](int64_t, std::span<std::byte* const>) {}, /*write=*/false);
      r.push_back(total / secs(t0) / 1e9);
      t0 = Clock::now();
      s.pass(touch);
      u.push_back(2 * total / secs(t0) / 1e9);
      serial.push_back(serial_update_gbs(paths, o.bytes, s.chunk_bytes()));
    }
    Disk d;
    d.write_gbs = median(w);
    d.read_gbs = median(r);
    d.update_gbs = median(u);
    d.serial_update_gbs = median(serial);
    d.chunk_bytes = s.chunk_bytes();
    d.dir = o.dir;
    d.source = s.direct() ? "measured by kuai bench disk (O_DIRECT)"
                          : "measured by kuai bench disk (through the page cache: no O_DIRECT)";
    for (const std::string& p : paths) fs::remove(p);
    return d;
  }
}

std::string disk_file() { return cache_file("disk.json"); }

std::optional<Disk> measured_disk() {
  std::ifstream in(disk_file());
  if (!in) return std::nullopt;
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    Disk d;
    d.read_gbs = j.at("read_gbs").get<double>();
    d.write_gbs = j.at("write_gbs").get<double>();
    d.update_gbs = j.at("update_gbs").get<double>();
    d.chunk_bytes = j.at("chunk_bytes").get<int64_t>();
    d.dir = j.at("dir").get<std::string>();
    d.source = fmt::format("measured by kuai bench disk ({})", disk_file());
    if (!(d.read_gbs > 0) || !(d.write_gbs > 0) || !(d.update_gbs > 0)) return std::nullopt;
    return d;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

void save_disk(const Disk& d) {
  save_file_atomically(disk_file(), nlohmann::json{{"read_gbs", d.read_gbs},
                                                   {"write_gbs", d.write_gbs},
                                                   {"update_gbs", d.update_gbs},
                                                   {"chunk_bytes", d.chunk_bytes},
                                                   {"dir", d.dir}}
                                            .dump(2) +
                                        "\n");
}

}  // namespace kuai::plan

// `kuai bench disk`'s measurement (kuai/plan/disk.h): it streams real files at the chunk size,
// reports positive bandwidths, removes its files, and what it saves is what the planner reads.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "kuai/plan/disk.h"

namespace kuai::plan {
namespace {

TEST(Disk, MeasuredSavedAndReadBack) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("kuai_disk_" + std::to_string(::getpid()));
  DiskBenchOptions o;
  o.dir = (dir / "scratch").string();
  o.bytes = 3 << 20;
  o.chunk_bytes = 1 << 20;
  o.rounds = 1;
  const Disk d = measure_disk(o);
  EXPECT_GT(d.read_gbs, 0);
  EXPECT_GT(d.write_gbs, 0);
  EXPECT_GT(d.update_gbs, 0);
  EXPECT_EQ(d.chunk_bytes, 1 << 20);
  EXPECT_TRUE(fs::is_empty(o.dir));  // its files are gone
  // Two GB read and one written at 1 GB/s each (no update figure): 3 s.
  Disk flat;
  flat.read_gbs = flat.write_gbs = 1;
  EXPECT_DOUBLE_EQ(flat.seconds(2e9, 1e9), 3.0);
  flat.update_gbs = 1.5;  // a pass moving both ways at once
  EXPECT_DOUBLE_EQ(flat.seconds(2e9, 1e9), 2.0);

  const char* old = std::getenv("XDG_CACHE_HOME");
  const std::string saved = old ? old : "";
  ::setenv("XDG_CACHE_HOME", (dir / "cache").c_str(), 1);
  EXPECT_FALSE(measured_disk().has_value());
  save_disk(d);
  const std::optional<Disk> back = measured_disk();
  ASSERT_TRUE(back.has_value());
  EXPECT_DOUBLE_EQ(back->read_gbs, d.read_gbs);
  EXPECT_DOUBLE_EQ(back->update_gbs, d.update_gbs);
  EXPECT_EQ(back->dir, d.dir);
  if (old)
    ::setenv("XDG_CACHE_HOME", saved.c_str(), 1);
  else
    ::unsetenv("XDG_CACHE_HOME");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kuai::plan

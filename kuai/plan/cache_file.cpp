// The planner's saved figures (see cache_file.h).
#include "kuai/plan/cache_file.h"

#include <cstdlib>
#include <filesystem>

#include "kuai/io/text_file.h"

namespace kuai::plan {

std::string cache_file(const std::string& name) {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  const std::string base =
      xdg && *xdg ? xdg : std::string(home && *home ? home : "/tmp") + "/.cache";
  return base + "/kuai/" + name;
}

void save_file_atomically(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  io::write_text_atomically(path, text);
}

}  // namespace kuai::plan

// Where the figures `kuai bench` measures on this machine are kept for `kuai plan` (the link, the
// disk): ${XDG_CACHE_HOME:-$HOME/.cache}/kuai/<name>, written whole or not at all.
#pragma once

#include <string>

namespace kuai::plan {

std::string cache_file(const std::string& name);
// Writes `text` to path through a temporary file renamed over it (folders made as needed).
void save_file_atomically(const std::string& path, const std::string& text);

}  // namespace kuai::plan

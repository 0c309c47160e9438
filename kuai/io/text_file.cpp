// Atomic small-file writes (see text_file.h).
#include "kuai/io/text_file.h"

#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace kuai::io {

void write_text_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << text;
    f.flush();
    if (!f) throw std::runtime_error(tmp + ": cannot write");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec)
    throw std::runtime_error(path + ": cannot rename " + tmp + " into place (" + ec.message() +
                             ")");
}

}  // namespace kuai::io

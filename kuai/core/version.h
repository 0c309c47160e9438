// kuai's version, written into the files it saves (exports, checkpoints).
#pragma once

namespace kuai {

inline constexpr char kKuaiVersion[] = "0.3.0";

}  // namespace kuai

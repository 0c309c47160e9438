// Detects the CPU's ISA tier and applies the KUAI_MAX_ISA cap (see isa.h).
#include "kuai/backend/cpu/isa.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace kuai::cpu {
namespace {

Isa detect() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  __builtin_cpu_init();
  // __builtin_cpu_supports takes string literals only, so each tier is spelled out.
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi") &&
                    __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
  if (!avx2) return Isa::kBaseline;
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512cd");
  if (!avx512) return Isa::kAvx2;
  if (!__builtin_cpu_supports("avx512bf16")) return Isa::kAvx512;
  if (!(__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16")))
    return Isa::kAvx512Bf16;
  return Isa::kAmx;
#elif defined(__x86_64__) && defined(__clang__)
  // clang 14 lacks some of the names above; the portable tier is always correct.
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? Isa::kAvx2
                                                                         : Isa::kBaseline;
#else
  return Isa::kBaseline;
#endif
}

std::string allowed_values() {
  std::string s;
  for (Isa t : kAllIsas) s += (s.empty() ? "" : " | ") + std::string(isa_name(t));
  return s;
}

Isa resolve() {
  const Isa cpu = cpu_isa();
  const std::string request = max_isa_request();
  if (request.empty()) return cpu;
  const std::optional<Isa> cap = parse_isa(request);
  if (!cap) {
    throw std::invalid_argument("KUAI_MAX_ISA=" + request +
                                ": not a tier (allowed: " + allowed_values() + ")");
  }
  return std::min(cpu, *cap);
}

}  // namespace

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::kBaseline:
      return "baseline";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Bf16:
      return "avx512_bf16";
    case Isa::kAmx:
      return "amx";
  }
  return "baseline";
}

std::optional<Isa> parse_isa(std::string_view name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (Isa t : kAllIsas)
    if (lower == isa_name(t)) return t;
  return std::nullopt;
}

Isa cpu_isa() {
  static const Isa detected = detect();
  return detected;
}

Isa isa() {
  static const Isa tier = resolve();  // a throw leaves it unset: the next call throws again
  return tier;
}

const char* isa_name() { return isa_name(clone_variant()).data(); }

const CpuId& cpu_id() {
  static const CpuId id = [] {
    CpuId c;
#if defined(__x86_64__)
    unsigned a = 0, b = 0, cx = 0, d = 0;
    if (__get_cpuid(0, &a, &b, &cx, &d)) {
      char v[13] = {};
      std::memcpy(v, &b, 4);
      std::memcpy(v + 4, &d, 4);
      std::memcpy(v + 8, &cx, 4);
      c.vendor = v;
    }
    if (__get_cpuid(1, &a, &b, &cx, &d)) {
      const int base_family = (a >> 8) & 0xf, ext_family = (a >> 20) & 0xff;
      const int base_model = (a >> 4) & 0xf, ext_model = (a >> 16) & 0xf;
      c.family = base_family == 0xf ? base_family + ext_family : base_family;
      c.model =
          base_family == 0x6 || base_family == 0xf ? (ext_model << 4) | base_model : base_model;
      c.stepping = a & 0xf;
    }
    unsigned max_ext = __get_cpuid_max(0x80000000, nullptr);
    if (max_ext >= 0x80000004) {
      char brand[49] = {};
      for (unsigned i = 0; i < 3; ++i) {
        unsigned r[4];
        __get_cpuid(0x80000002 + i, &r[0], &r[1], &r[2], &r[3]);
        std::memcpy(brand + 16 * i, r, 16);
      }
      std::string name(brand);
      const size_t first = name.find_first_not_of(' ');
      c.model_name = first == std::string::npos ? "" : name.substr(first);
    }
#endif
    return c;
  }();
  return id;
}

std::string cpu_flags_report() {
  std::string out;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  __builtin_cpu_init();
  auto flag = [&out](const char* name, bool on) {
    if (!out.empty()) out += ' ';
    out += name;
    out += on ? '+' : '-';
  };
  flag("avx2", __builtin_cpu_supports("avx2"));
  flag("fma", __builtin_cpu_supports("fma"));
  flag("f16c", __builtin_cpu_supports("f16c"));
  flag("avx512f", __builtin_cpu_supports("avx512f"));
  flag("avx512bw", __builtin_cpu_supports("avx512bw"));
  flag("avx512vl", __builtin_cpu_supports("avx512vl"));
  flag("avx512_bf16", __builtin_cpu_supports("avx512bf16"));
  flag("avx512_fp16", __builtin_cpu_supports("avx512fp16"));
  flag("amx_tile", __builtin_cpu_supports("amx-tile"));
  flag("amx_bf16", __builtin_cpu_supports("amx-bf16"));
#endif
  return out;
}

std::string max_isa_request() {
  const char* v = std::getenv("KUAI_MAX_ISA");
  return v != nullptr ? std::string(v) : std::string();
}

}  // namespace kuai::cpu

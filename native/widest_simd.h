// The widest SIMD body this CPU allows for vattn's own kernels, capped as torch caps its own
// by ATEN_CPU_CAPABILITY (`avx2` or `default`): torch does not export its own choice.
#pragma once

#include <cstdlib>
#include <string>

inline const std::string& widest_simd() {
  static const std::string widest = [] {
#if defined(__x86_64__)
    const char* asked = std::getenv("ATEN_CPU_CAPABILITY");
    const std::string cap = asked ? asked : "";
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    if (cap == "default" || !avx2) return std::string("scalar");
    return std::string(avx512 && cap != "avx2" ? "avx512" : "avx2");
#else
    return std::string("scalar");
#endif
  }();
  return widest;
}

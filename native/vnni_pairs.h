// Two rows' 16 bf16 values each interleaved into VNNI pairs, the layout vdpbf16ps and brgemm's
// bf16 B operand take (two rows of the reduction side in one 32-bit lane): the 32 values
// even[0], odd[0], even[1], odd[1], ... The ragged kernel's packed values and brgemm_attention's
// both write it.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) inline __m512i interleave_pairs(__m256i even,
                                                                                              __m256i odd) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1));
}
#endif

// What every x86 vector unit reads its weights with: an fp16 scale as fp32 and unaligned loads of 64, 128 and 256 bits,
// and the fixed-tree sum of an 8-lane fp32 vector. Plain intrinsics of AVX2 and F16C, so each unit (qmatmul_avx2.cpp,
// qmatmul_avx2_int8.cpp, qmatmul_avx512.cpp, qmatmul_vnni.cpp) includes it after its target pragma and
// <immintrin.h>, inside its anonymous namespace: its own copy, compiled for its ISA.
#pragma once

inline __attribute__((always_inline)) float h2f(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);  // fp16 -> fp32 is exact
}

inline __attribute__((always_inline)) __m128i load64(const uint8_t* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}
inline __attribute__((always_inline)) __m128i load128(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
inline __attribute__((always_inline)) __m256i load256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Lanes summed in a fixed tree (halves, then pairs, then the last two), whatever the caller.
inline __attribute__((always_inline)) float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

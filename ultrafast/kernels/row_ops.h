// Per-row helpers shared by the baseline units (qmatmul.cpp, decoder_layer.cpp, scalar.cpp): fixed
// reduction trees, so every caller computes a row with the same operations. Not for the AVX-512 units (see
// qmatmul_kernels.h).
#pragma once
#include <stdint.h>

#include <cmath>

namespace ultrafast {

// 16 lane sums -> one, by a fixed tree.
inline float lane_sum16(const float* a) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// y = x * rsqrt(mean(x^2) + eps) * w over one row of d values.
inline void rmsnorm_row(const float* x, const float* w, int64_t d, float eps, float* y) {
  float a[16] = {0};
  for (int64_t i = 0; i < d; ++i) a[i & 15] = a[i & 15] + x[i] * x[i];
  const float mean = lane_sum16(a) / (float)d;
  const float inv = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < d; ++i) y[i] = (x[i] * inv) * w[i];
}

}  // namespace ultrafast

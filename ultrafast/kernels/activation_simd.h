// The feed-forward's gated activation g = silu(g) * u over a vector of float lanes, written once over the
// vector type V of attention_simd.h: the AVX-512 unit (16 lanes) and the AVX2 unit (8 lanes) instantiate it
// inside their target pragmas. Beside attention_simd.h's operations it uses V::div(a, b) = a / b and
// V::select_nonneg(z, a, b) = z >= 0 ? a : b, lane by lane.
//
// silu(z) = z * sigmoid(z) with e = exp(-|z|) <= 1 (exp_neg, never overflowing): sigmoid(z) = 1 / (1 + e)
// for z >= 0, e / (1 + e) below: within a few ulp of float64 for z >= -87; below it |result| < 1e-35 * |u|
// (the exact value is smaller still). Each element's result is one fixed sequence of operations on (g[i], u[i])
// alone (a masked tail runs the same ones), so it is the same bits whatever n is, wherever the element sits
// and however a caller splits a range between threads: batch invariance holds.
#pragma once
#include <stdint.h>

#include "exp_simd.h"

namespace ultrafast {
namespace {

template <class V>
inline typename V::F silu_mul_lanes(typename V::F z, typename V::F u) {
  using F = typename V::F;
  const F zero = V::zero(), one = V::set1(1.0f);
  const F e = exp_neg<V>(V::sub(zero, V::max(z, V::sub(zero, z))));  // exp(-|z|), exp(-87) below that
  const F sig = V::div(V::select_nonneg(z, one, e), V::add(one, e));
  // z below -88 multiplies sigmoid's floor exp(-87) as -88 (the result stays below 1e-35; NaN stays NaN)
  return V::mul(V::mul(V::max(V::set1(-88.0f), z), sig), u);
}

// g[i] = silu(g[i]) * u[i] for i < n
template <class V>
inline void silu_mul(float* g, const float* u, int64_t n) {
  int64_t i = 0;
  for (; i + V::W <= n; i += V::W) V::store(g + i, silu_mul_lanes<V>(V::load(g + i), V::load(u + i)));
  if (i < n) {
    const int rest = (int)(n - i);
    V::store_first(g + i, silu_mul_lanes<V>(V::load_first(g + i, rest), V::load_first(u + i, rest)), rest);
  }
}

}  // namespace
}  // namespace ultrafast

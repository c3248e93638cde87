// exp of a vector of float lanes, written once over the vector type V of attention_simd.h (fma, mul, add,
// fnmadd, max, set1, round, scale2n): the AVX-512 and AVX2 units instantiate it inside their target pragmas.
// Used by the attention's softmax (attention_simd.h) and the feed-forward's SiLU (activation_simd.h).
#pragma once

namespace ultrafast {
namespace {

// exp for x <= 0 (softmax arguments, the SiLU's e^-|z|): Cephes expf polynomial; ~1 ulp.
template <class V>
inline typename V::F exp_neg(typename V::F x) {
  using F = typename V::F;
  x = V::max(x, V::set1(-87.0f));
  const F n = V::round(V::mul(x, V::set1(1.44269504088896341f)));
  F r = V::fnmadd(n, V::set1(0.693359375f), x);
  r = V::fnmadd(n, V::set1(-2.12194440e-4f), r);
  F p = V::set1(1.9875691500e-4f);
  p = V::fma(p, r, V::set1(1.3981999507e-3f));
  p = V::fma(p, r, V::set1(8.3334519073e-3f));
  p = V::fma(p, r, V::set1(4.1665795894e-2f));
  p = V::fma(p, r, V::set1(1.6666665459e-1f));
  p = V::fma(p, r, V::set1(5.0000001201e-1f));
  p = V::fma(p, V::mul(r, r), V::add(r, V::set1(1.0f)));
  return V::scale2n(p, n);
}

}  // namespace
}  // namespace ultrafast

// One-query causal attention for a group of heads sharing one kv head, written once over a vector of float
// lanes: the AVX-512 unit (16 lanes) and the AVX2 unit (8 lanes) each instantiate it with their own vector
// (the contract is attn_group_avx512's in qmatmul_kernels.h).
//
// Plain C++ in an anonymous namespace, like qmatmul_fp32.h: each unit that includes it (inside its target
// pragma) gets its own copy for its ISA, which the linker never merges with another unit's.
//
// A vector type V provides
//   F, W (lanes), HEADS (heads per value pass: their accumulators fit the registers)
//   zero(), set1(x), load(p), store(p, v), fma(a, b, c) = a * b + c, mul, add, sub, max
//   load_first(p, n) / keep_first(v, n): lanes >= n zero;  store_first(p, v, n): lanes < n only
//   fnmadd(a, b, c) = c - a * b (fused);  round(v) to the nearest integer;  scale2n(p, n) = p * 2^n (n integral,
//   n >= -126);  reduce_max(v);  reduce_add(v) (one fixed order)
//   transpose_reduce(a): lane t = a fixed-tree sum of the W lanes of a[t], no lane reaching another output
//   SCORE_HEADS, SCORE_KEYS: pass 1's tile of heads x keys (SCORE_KEYS divides W; 1 head: a head's W keys at a time)
//
// The three passes (scores, softmax, values) run in a fixed order that depends only on the head's query, the
// L keys/values and L, so a head's result is the same whatever G is, and the same bits whether its keys are
// the cache's contiguous rows or listed (a token tree's ancestors).
#pragma once
#include <stdint.h>

#include "exp_simd.h"

namespace ultrafast {
namespace {

// out[g] = inv[g] * sum_j p[g][j] * v_j over dims [W*v0, W*(v0+NV)) for G <= V::HEADS heads (NV <= 4). Value
// rows: j < P are rows j, later ones rows extra[j - P] (the same accumulation order either way); a row r < P0 is
// read from vc0 (a sibling sequence's cache holding the same row) instead of vc.
template <class V, int NV, int G>
__attribute__((noinline)) void attn_pv_chunk(const float* vc, int64_t L, int64_t hd, const float* sc, int64_t lds,
                                             int v0, const float* inv, float* out, int64_t P, const int32_t* extra,
                                             const float* vc0, int64_t P0) {
  using F = typename V::F;
  F o[G][NV];
#pragma GCC unroll 6
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) o[g][v] = V::zero();
  const float *vb = vc + V::W * v0, *vb0 = vc0 + V::W * v0;
  for (int64_t j = 0; j < L; ++j) {
    F vv[NV];
    const int64_t jr = extra == nullptr || j < P ? j : (int64_t)extra[j - P];
    const float* vr = (jr < P0 ? vb0 : vb) + jr * hd;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vv[v] = V::load(vr + V::W * v);
#pragma GCC unroll 6
    for (int g = 0; g < G; ++g) {
      const F pj = V::set1(sc[g * lds + j]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) o[g][v] = V::fma(pj, vv[v], o[g][v]);
    }
  }
#pragma GCC unroll 6
  for (int g = 0; g < G; ++g) {
    const F iv = V::set1(inv[g]);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) V::store(out + g * hd + V::W * (v0 + v), V::mul(o[g][v], iv));
  }
}

// The chunk for gc heads, 1 <= gc <= G (from G = V::HEADS down).
template <class V, int NV, int G = V::HEADS>
inline void attn_pv_heads(int gc, const float* vc, int64_t L, int64_t hd, const float* sc, int64_t lds, int v0,
                          const float* inv, float* out, int64_t P, const int32_t* ex, const float* vc0, int64_t P0) {
  if constexpr (G > 1) {
    if (gc < G) return attn_pv_heads<V, NV, G - 1>(gc, vc, L, hd, sc, lds, v0, inv, out, P, ex, vc0, P0);
  }
  attn_pv_chunk<V, NV, G>(vc, L, hd, sc, lds, v0, inv, out, P, ex, vc0, P0);
}

// Pass 1's partial sums for GT heads (queries q + g * hd) and the KT keys kb + (t0 + t) * hd, t < KT: part[g][t0 + t]
// (one vector each; transpose_reduce later sums its lanes). Each is the chain of fmas over the nv dimension vectors in
// order, as when a head's keys are scored alone (the same bits), but every key vector is loaded once for the GT heads,
// where head by head a load went with every fma. On the AMD EPYC (Zen 4), one thread, 1.5B shapes (12 heads, 2 kv
// heads, head_dim 128), alternated with head by head: 16 queries over 2000 keys 2.20-2.35 ms against 2.61-2.65, over
// 150 keys 0.24 against 0.26, 10 queries over 400 keys 0.41-0.44 against 0.44-0.55 (the AVX2 unit's 2 x 4 tile: no
// gain, so it stays head by head).
template <class V, int GT, int KT>
inline __attribute__((always_inline)) void score_tile(const float* q, const float* kb, int64_t nv, int64_t hd,
                                                      typename V::F (*part)[V::W], int t0) {
  using F = typename V::F;
  constexpr int W = V::W;
  F acc[GT][KT];
#pragma GCC unroll 4
  for (int g = 0; g < GT; ++g)
#pragma GCC unroll 16
    for (int t = 0; t < KT; ++t) acc[g][t] = V::zero();
  for (int64_t v = 0; v < nv; ++v) {
    F qv[GT];
#pragma GCC unroll 4
    for (int g = 0; g < GT; ++g) qv[g] = V::load(q + g * hd + W * v);
#pragma GCC unroll 16
    for (int t = 0; t < KT; ++t) {
      F kv = V::load(kb + (t0 + t) * hd + W * v);
      if constexpr (GT > 1) __asm__("" : "+v"(kv));  // in a register: else the compiler folds the load into each fma
#pragma GCC unroll 4
      for (int g = 0; g < GT; ++g) acc[g][t] = V::fma(qv[g], kv, acc[g][t]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GT; ++g)
#pragma GCC unroll 16
    for (int t = 0; t < KT; ++t) part[g][t0 + t] = acc[g][t];
}

// score_tile for gt <= V::SCORE_HEADS heads.
template <class V, int GT = V::SCORE_HEADS>
inline __attribute__((always_inline)) void score_heads(int gt, const float* q, const float* kb, int64_t nv,
                                                       int64_t hd, typename V::F (*part)[V::W], int t0) {
  if constexpr (GT > 1) {
    if (gt < GT) return score_heads<V, GT - 1>(gt, q, kb, nv, hd, part, t0);
  }
  score_tile<V, GT, V::SCORE_KEYS>(q, kb, nv, hd, part, t0);
}

template <class V>
void attention_group(const float* q, int G, const float* kc, const float* vc, int64_t L, int64_t hd, float scale,
                     float* scores, int64_t lds, float* out, int64_t P, const int32_t* extra, const float* kc0,
                     const float* vc0, int64_t P0) {
  using F = typename V::F;
  constexpr int W = V::W;
  // Heads g < G (query vectors q + g*hd, outputs out + g*hd) all read the same kv head, so every key and
  // value row is loaded once for the group. Per head the arithmetic is the same whatever G is.
  const int64_t nv = hd / W;
  if (extra == nullptr) P = L;
  if (kc0 == nullptr || vc0 == nullptr || hd > 256) P0 = 0, kc0 = kc, vc0 = vc;  // (the same rows either way)
  // pass 1: scores, W keys at a time; a partial last block leaves the missing keys' sums at zero. Blocks past
  // the contiguous prefix (a tree's ancestors) gather their rows into `tb` first: the same values in the same
  // lanes, so the same sums.
  alignas(64) float tb[W * 256];
  for (int64_t j0 = 0; j0 < L; j0 += W) {
    const int cnt = L - j0 < W ? (int)(L - j0) : W;
    const float* kb = (j0 + cnt <= P0 ? kc0 : kc) + j0 * hd;
    if ((j0 + cnt > P || (j0 < P0 && j0 + cnt > P0)) && hd <= 256) {
      for (int t = 0; t < cnt; ++t) {
        const int64_t j = j0 + t, jr = j < P ? j : (int64_t)extra[j - P];
        __builtin_memcpy(tb + t * hd, (jr < P0 ? kc0 : kc) + jr * hd, sizeof(float) * (size_t)hd);
      }
      kb = tb;
    }
    if (cnt == W) {  // a whole block: tiles of heads x keys (score_tile)
      for (int g0 = 0; g0 < G; g0 += V::SCORE_HEADS) {
        const int gt = G - g0 < V::SCORE_HEADS ? G - g0 : V::SCORE_HEADS;
        F part[V::SCORE_HEADS][W];
        for (int t0 = 0; t0 < W; t0 += V::SCORE_KEYS) score_heads<V>(gt, q + g0 * hd, kb, nv, hd, part, t0);
        for (int g = 0; g < gt; ++g)
          V::store_first(scores + (g0 + g) * lds + j0, V::mul(V::transpose_reduce(part[g]), V::set1(scale)), cnt);
      }
      continue;
    }
    for (int g = 0; g < G; ++g) {  // the last, partial block: head by head, its cnt keys
      const float* qg = q + g * hd;
      F acc[W];
#pragma GCC unroll 16
      for (int t = 0; t < W; ++t) acc[t] = V::zero();
      for (int64_t v = 0; v < nv; ++v) {
        const F qv = V::load(qg + W * v);
        for (int t = 0; t < cnt; ++t) acc[t] = V::fma(qv, V::load(kb + t * hd + W * v), acc[t]);
      }
      V::store_first(scores + g * lds + j0, V::mul(V::transpose_reduce(acc), V::set1(scale)), cnt);
    }
  }
  // pass 2: per head, max (order-independent), exponentials and their sum over W lanes in a fixed order
  float inv[64];
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * lds;
    F mxv = V::set1(-__builtin_inff());
    int64_t j = 0;
    for (; j + W <= L; j += W) mxv = V::max(mxv, V::load(sg + j));
    float mx = V::reduce_max(mxv);
    for (int64_t t = j; t < L; ++t) mx = sg[t] > mx ? sg[t] : mx;
    const F vmx = V::set1(mx);
    F sum = V::zero();
    for (j = 0; j + W <= L; j += W) {
      const F e = exp_neg<V>(V::sub(V::load(sg + j), vmx));
      V::store(sg + j, e);
      sum = V::add(sum, e);
    }
    if (j < L) {  // the tail's lanes past L are zero
      const int cnt = (int)(L - j);
      const F e = V::keep_first(exp_neg<V>(V::sub(V::load_first(sg + j, cnt), vmx)), cnt);
      V::store_first(sg + j, e, cnt);
      sum = V::add(sum, e);
    }
    inv[g] = 1.0f / V::reduce_add(sum);
  }
  // pass 3: weighted sums of the values, 4 vectors of dims x up to HEADS heads at a time (value rows loaded
  // once for them)
  for (int g0 = 0; g0 < G; g0 += V::HEADS) {
    const int gc = G - g0 < V::HEADS ? G - g0 : V::HEADS;
    const float* sc = scores + g0 * lds;
    float* og = out + g0 * hd;
    for (int v0 = 0; v0 < (int)nv; v0 += 4) {
      switch ((int)nv - v0 < 4 ? (int)nv - v0 : 4) {
        case 1: attn_pv_heads<V, 1>(gc, vc, L, hd, sc, lds, v0, inv + g0, og, P, extra, vc0, P0); break;
        case 2: attn_pv_heads<V, 2>(gc, vc, L, hd, sc, lds, v0, inv + g0, og, P, extra, vc0, P0); break;
        case 3: attn_pv_heads<V, 3>(gc, vc, L, hd, sc, lds, v0, inv + g0, og, P, extra, vc0, P0); break;
        default: attn_pv_heads<V, 4>(gc, vc, L, hd, sc, lds, v0, inv + g0, og, P, extra, vc0, P0); break;
      }
    }
  }
}

}  // namespace
}  // namespace ultrafast

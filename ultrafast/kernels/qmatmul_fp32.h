// What the fp32 kernel variants share (qmatmul_avx512.cpp, qmatmul_avx2.cpp): the prepared activation row
// of each weight type (x permuted into the order of the packed weights' lanes, pre-scaled by exact powers of
// two, with per-block sums of x for block offsets and mins; see qmatmul_avx512.cpp) and the tiled driver
// that runs a variant's per-block products over weight rows, K panels and activation-row chunks.
//
// Plain C++ with no intrinsics, and everything in an anonymous namespace: each unit that includes it gets
// its own copy, compiled for that unit's ISA, that the linker never merges with another unit's (see
// qmatmul_kernels.h). The 16-value vectors of the layouts are one AVX-512 register, or two AVX2 registers
// (lanes 0..7, then 8..15).
//
// A kernel type T used by the driver derives from one of the layouts below (B, BYTES, UNIT, UNIT_BYTES, XS,
// NATIVE_PARTIAL, prep) and adds
//   Acc, init(acc), finish(acc)   per (weight row, activation row) accumulators and their fixed-order sum
//   block<R>(p, xp, xs, ldx, ldxs, acc)   one kernel block for R activation rows
//   partial<R>(p, nunits, ...)    the short last block of a row, where NATIVE_PARTIAL
#pragma once
#include <stdint.h>

#include "qmatmul_kernels.h"

namespace ultrafast {
namespace {

// 2^-e as float (exact), e in [0, 126]
inline float pow2neg(int e) {
  const uint32_t bits = (uint32_t)(127 - e) << 23;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// Fixed-order sum of n consecutive floats (prep only).
inline float seqsum(const float* x, int n) {
  float a = 0.0f;
  for (int i = 0; i < n; ++i) a = a + x[i];
  return a;
}

// ---- Q4_K: 256 values = 8 sub-blocks of 32 with 6-bit scales/mins. The 128 bytes of nibbles are read as
// two 64-byte chunks of 16 dwords; vector n (0..7) of chunk c is (dword & 0xF << 4n), i.e. byte n>>1 of each
// dword, low nibble for even n (sub-block 2g) and high nibble for odd n (2g+1), where lanes 0..7 hold
// group g = 2c and lanes 8..15 group 2c+1.
struct LQ4_K {
  static constexpr int B = 256, BYTES = 144, UNIT = 256, UNIT_BYTES = 144, XS = 8;
  static constexpr bool NATIVE_PARTIAL = false;  // K % 256 == 0 always
  static void prep(const float* x, int64_t K, int64_t Kp, float* xp, float* xs) {
    for (int64_t s = 0; s < K / 256; ++s) {
      const float* xb = x + s * 256;
      float* o = xp + s * 256;
      for (int c = 0; c < 2; ++c)
        for (int n = 0; n < 8; ++n) {
          const float sc = pow2neg(4 * n);
          for (int j = 0; j < 16; ++j) {
            const int byte = 4 * j + (n >> 1), g = 2 * c + (byte >> 5), b = byte & 31, h = n & 1;
            o[c * 128 + n * 16 + j] = xb[64 * g + 32 * h + b] * sc;
          }
        }
      for (int sb = 0; sb < 8; ++sb) xs[s * 8 + sb] = seqsum(xb + 32 * sb, 32);
    }
    (void)Kp;
  }
};

// ---- Q6_K: 256 values, q = 4 low bits (ql) | 2 high bits (qh) << 4, value = d * scale[e/16] * (q - 32).
// Per 128-value half, the 6-bit values are first assembled as bytes (A: values 0..63 of the half, Bv:
// 64..127), then vector c (0..3) of A is (dword & 0x3F << 8c): lane j holds value 4j + c, so lanes 4g..4g+3
// all belong to scale group g. The -32 offset goes through per-group sums of x (prep stores -32 * sum).
struct LQ6_K {
  static constexpr int B = 256, BYTES = 210, UNIT = 256, UNIT_BYTES = 210, XS = 16;
  static constexpr bool NATIVE_PARTIAL = false;  // K % 256 == 0 always
  static void prep(const float* x, int64_t K, int64_t Kp, float* xp, float* xs) {
    for (int64_t s = 0; s < K / 256; ++s) {
      const float* xb = x + s * 256;
      float* o = xp + s * 256;
      for (int q = 0; q < 4; ++q)  // q = 2h + (A or B)
        for (int c = 0; c < 4; ++c) {
          const float sc = pow2neg(8 * c);
          for (int j = 0; j < 16; ++j) o[q * 64 + c * 16 + j] = xb[64 * q + 4 * j + c] * sc;
        }
      for (int g = 0; g < 16; ++g) xs[s * 16 + g] = -32.0f * seqsum(xb + 16 * g, 16);
    }
    (void)Kp;
  }
};

// ---- Q4_0 / Q4_1: a kernel block is 4 GGUF blocks of 32 (128 values). Their 4 x 16 bytes of nibbles form
// one vector of 16 dwords (lanes 4b..4b+3 = block b); vector n (0..7) is (dword & 0xF << 4n): value
// 16*(n&1) + 4*(j%4) + (n>>1) of block j/4. Q4_1: d*q + m; Q4_0: d*q - 8d (offsets via per-block x sums,
// which prep stores pre-multiplied by -8 for Q4_0).
template <bool Q41>
struct LQ4_01 {
  static constexpr int BB = Q41 ? 20 : 18;  // bytes per GGUF block
  static constexpr int QOFF = Q41 ? 4 : 2;  // offset of the nibbles in a block
  static constexpr int B = 128, BYTES = 4 * BB, UNIT = 32, UNIT_BYTES = BB, XS = 4;
  static constexpr bool NATIVE_PARTIAL = false;  // a variant with its own partial() says so
  static void prep(const float* x, int64_t K, int64_t Kp, float* xp, float* xs) {
    const int64_t nblk = K / 32;
    for (int64_t g = 0; g < Kp / 128; ++g) {
      float* o = xp + g * 128;
      for (int n = 0; n < 8; ++n) {
        const float sc = pow2neg(4 * n);
        for (int j = 0; j < 16; ++j) {
          const int64_t blk = 4 * g + j / 4;
          o[n * 16 + j] = blk < nblk ? x[blk * 32 + 16 * (n & 1) + 4 * (j % 4) + (n >> 1)] * sc : 0.0f;
        }
      }
      for (int b = 0; b < 4; ++b)
        xs[g * 4 + b] = 4 * g + b < nblk ? (Q41 ? 1.0f : -8.0f) * seqsum(x + (4 * g + b) * 32, 32) : 0.0f;
    }
  }
};

// ---- Q5_0, Q8_0 and the float types: decoded to their exact dequantized values, x as it is (zero-padded).
template <int BYTES_, int UNIT_, int UNIT_BYTES_>
struct LDirect {
  static constexpr int B = 32, BYTES = BYTES_, UNIT = UNIT_, UNIT_BYTES = UNIT_BYTES_, XS = 0;
  static constexpr bool NATIVE_PARTIAL = false;  // float types with K % 32 != 0: zero-padded copy
  static void prep(const float* x, int64_t K, int64_t Kp, float* xp, float*) {
    for (int64_t i = 0; i < K; ++i) xp[i] = x[i];
    for (int64_t i = K; i < Kp; ++i) xp[i] = 0.0f;
  }
};

// ----------------------------------------------------------------------------------------------------
// Driver. Rows are visited in groups of G; K is cut into panels of P values so that the panel of x' for
// up to RMAX activation rows and of the G weight rows stays in L1/L2 while every (weight row, activation
// row chunk) pair sweeps it. Accumulators live in `st` between panels (bit-exact round trip). RMAX is the
// variant's: as many activation rows as its registers hold accumulators and decoded weights for.

constexpr int G = 16;
// Panel length (values), measured: with one activation row the whole row of x' is best (streaming it
// from L2 keeps up); with more rows keep the x' panel of one row chunk around 16 KiB.
inline int64_t panel_values(int64_t k) { return k <= 1 ? ((int64_t)1 << 40) : (k == 2 ? 2048 : 1024); }

// Rows [0, g) of a row group (weight rows `rb` bytes apart), blocks [b0, b1) of K, activation rows [0, R)
// of the current chunk; st[j * k + r] holds the accumulators of weight row j and activation row r.
template <class T, int R>
__attribute__((noinline)) void run(const uint8_t* __restrict w, int64_t rb, int64_t g, int64_t b0, int64_t b1,
                                   int64_t nfull, int64_t K, const float* __restrict xp, const float* __restrict xs,
                                   int64_t ldx, int64_t ldxs, typename T::Acc* st, int64_t k) {
  const int64_t bf = b1 < nfull ? b1 : nfull;
  for (int64_t j = 0; j < g; ++j) {
    const uint8_t* wr = w + j * rb;
    typename T::Acc acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = st[j * k + r];
    for (int64_t b = b0; b < bf; ++b)
      T::template block<R>(wr + b * T::BYTES, xp + b * T::B, xs + b * T::XS, ldx, ldxs, acc);
    if (b1 > nfull) {  // partial last block (x' is zero-padded)
      const uint8_t* pl = wr + nfull * T::BYTES;
      const int64_t nunits = (K - nfull * T::B) / T::UNIT;
      if constexpr (T::NATIVE_PARTIAL) {
        T::template partial<R>(pl, nunits, xp + nfull * T::B, xs + nfull * T::XS, ldx, ldxs, acc);
      } else {  // decode a zero-padded copy
        alignas(64) uint8_t buf[T::BYTES + 64];
        for (int i = 0; i < T::BYTES + 64; ++i) buf[i] = 0;
        __builtin_memcpy(buf, pl, (size_t)(nunits * T::UNIT_BYTES));
        T::template block<R>(buf, xp + nfull * T::B, xs + nfull * T::XS, ldx, ldxs, acc);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) st[j * k + r] = acc[r];
  }
}

template <class T, int RMAX>
bool rows(const float* xp, const float* xs, int64_t ld, int64_t k, int64_t K, const uint8_t* w, int64_t rb, float* y,
          int64_t ldy, int64_t n0, int64_t n1) {
  static_assert(RMAX >= 1 && RMAX <= 4, "1 to 4 activation rows per chunk");
  using Acc = typename T::Acc;
  const int64_t nfull = K / T::B;
  const int64_t nblk = (K + T::B - 1) / T::B;
  const int64_t ldx = ld, ldxs = ld;  // x' and its sums, row r at xp + r * ld and xs + r * ld
  const int64_t PB = panel_values(k) / T::B > 0 ? panel_values(k) / T::B : 1;
  void* mem = __builtin_malloc(sizeof(Acc) * (size_t)(G * k) + 64);
  if (!mem) return false;
  Acc* st = reinterpret_cast<Acc*>(((uintptr_t)mem + 63) & ~(uintptr_t)63);
  for (int64_t n = n0; n < n1; n += G) {
    const int64_t g = n1 - n < G ? n1 - n : G;
    for (int64_t i = 0; i < g * k; ++i) T::init(st[i]);
    const uint8_t* wg = w + n * rb;
    if (nblk > PB && n + G < n1) {
      // several K panels: rows are read panel by panel (with gaps), which defeats the hardware prefetcher
      // on weights streamed from memory, so prefetch the next group's rows into L2 meanwhile
      prefetch_l2(wg + G * rb, (n1 - (n + G) < G ? n1 - (n + G) : G) * rb);
    }
    for (int64_t b0 = 0; b0 < nblk; b0 += PB) {
      const int64_t b1 = b0 + PB < nblk ? b0 + PB : nblk;
      for (int64_t r0 = 0; r0 < k; r0 += RMAX) {
        const int64_t rr = k - r0 < RMAX ? k - r0 : RMAX;
        const float* xr = xp + r0 * ldx;
        const float* sr = xs + r0 * ldxs;
        Acc* s = st + r0;
        // rr <= RMAX: the instantiations past RMAX (R = 1 stand-ins) are never called
        if (rr == 1) run<T, 1>(wg, rb, g, b0, b1, nfull, K, xr, sr, ldx, ldxs, s, k);
        else if (rr == 2) run<T, (RMAX >= 2 ? 2 : 1)>(wg, rb, g, b0, b1, nfull, K, xr, sr, ldx, ldxs, s, k);
        else if (rr == 3) run<T, (RMAX >= 3 ? 3 : 1)>(wg, rb, g, b0, b1, nfull, K, xr, sr, ldx, ldxs, s, k);
        else run<T, RMAX>(wg, rb, g, b0, b1, nfull, K, xr, sr, ldx, ldxs, s, k);
      }
    }
    for (int64_t j = 0; j < g; ++j)
      for (int64_t r = 0; r < k; ++r) y[r * ldy + n + j] = T::finish(st[j * k + r]);
  }
  __builtin_free(mem);
  return true;
}

// One prepared row: x' (nx floats: the values in the weights' lane order, zero-padded) then its block sums
// (ns floats), padded to 64 bytes; rows are `ld` floats apart.
template <class T>
struct PrepLayout {
  int64_t nx, ns, ld;
  explicit PrepLayout(int64_t K) {
    const int64_t nblk = (K + T::B - 1) / T::B;
    nx = nblk * T::B;
    ns = nblk * T::XS;
    ld = (nx + ns + 15) / 16 * 16;
  }
};

template <class T>
void prep_row(const float* x, int64_t K, uint8_t* xg) {
  const PrepLayout<T> l(K);
  float* xp = reinterpret_cast<float*>(xg);
  T::prep(x, K, l.nx, xp, xp + l.nx);
}

template <class T, int RMAX>
bool rows_prepared(const uint8_t* xg, int64_t k, int64_t K, const uint8_t* w, int64_t rb, float* y, int64_t ldy,
                   int64_t n0, int64_t n1) {
  const PrepLayout<T> l(K);
  const float* xp = reinterpret_cast<const float*>(xg);
  return rows<T, RMAX>(xp, xp + l.nx, l.ld, k, K, w, rb, y, ldy, n0, n1);
}

}  // namespace
}  // namespace ultrafast

// Runs the statements after qtype with T the including unit's kernel type for qtype (its names: KDirect<DF32>,
// KDirect<DF16>, KDirect<DBF16>, KQ4_01<false>, KQ4_01<true>, KDirect<DQ5_0>, KDirect<DQ8_0>, KQ4_K, KQ6_K);
// nothing for another type.
#define UF_FP32_DISPATCH(qtype, ...)                                  \
  switch (qtype) {                                                    \
    case QT_F32: { using T = KDirect<DF32>; __VA_ARGS__; break; }    \
    case QT_F16: { using T = KDirect<DF16>; __VA_ARGS__; break; }    \
    case QT_BF16: { using T = KDirect<DBF16>; __VA_ARGS__; break; }  \
    case QT_Q4_0: { using T = KQ4_01<false>; __VA_ARGS__; break; }   \
    case QT_Q4_1: { using T = KQ4_01<true>; __VA_ARGS__; break; }    \
    case QT_Q5_0: { using T = KDirect<DQ5_0>; __VA_ARGS__; break; }  \
    case QT_Q8_0: { using T = KDirect<DQ8_0>; __VA_ARGS__; break; }  \
    case QT_Q4_K: { using T = KQ4_K; __VA_ARGS__; break; }           \
    case QT_Q6_K: { using T = KQ6_K; __VA_ARGS__; break; }           \
    default: break;                                                   \
  }

// AVX2 integer kernels for 8-bit activations (and 16-bit ones, below): the "avx2-int8" linear ops, for
// CPUs without AVX-512 (Zen 1-3, most Intel client parts), where the fp32 kernels (qmatmul_avx2.cpp) convert every weight
// to float and multiply in fp32.
// Types: every quantized type in the file's layout: Q4_K and Q6_K (the Qwen2.5-Coder files' linears), and the
// 32-value block types Q4_0, Q4_1, Q5_0, Q8_0 (SmolLM2's, the 0.5B's, a draft head's Q8_0 linears); and Q4_K and Q6_K in
// the VNNI kernels' layouts made at load (QT_Q4_K_R2, QT_Q6_K_R16), which the engine gives these kernels
// (kernel_variant.cpp: layout_in_use): one sub-block / scale group per int32 lane, so a row's products add as int16
// before one vpmaddwd by the lanes' scales (Q4K2, Q6KR below). The 1.5B's linears at k = 10 and 16, 2 threads, Zen 3
// (`python -m ultrafast.benchmarks.kernel_shapes --model qwen2.5-coder-1.5b --ks 1,4,10,16 --activation-bits 8
// --vs-file-layout`): the Q4_K ones 0.74-0.87 of the file layout's time, the LM head (Q6_K) 0.90 / 0.77; k = 1 the same
// or a little faster.
//
// Numerics of Q4_K and Q6_K (llama.cpp's for these types on AVX2: its Q8_K activations): each activation row is
// quantized once per call, per super-block of 256 values, to int8: s = max|x| / 127, q_i = rint(x_i / s) (q = 0
// where max|x| = 0). The weights stay the file's small unsigned integers (Q4_K 0..15, Q6_K 0..63), multiplied with q
// by vpmaddubsw (unsigned byte x signed byte, adjacent pairs summed into int16: at most 2 * 63 * 127, never
// saturating), then by the sub-block's integer scale with vpmaddwd (int16 pairs into int32): the super-block's sum of
// sc_j * q_w . q_x is exact in int32. Q6_K's -32 offset is folded in exactly, as 32 * sum_g sc_g * (sum of q over scale group g). Per
// super-block that sum is converted to fp32 and applied as
//     acc += (d * s) * isum                 (then, Q4_K: acc -= (dmin * m_j) * (s * sum of q over sub-block j))
// with acc an 8-lane fp32 accumulator per output. The only approximation is the int8 rounding of x (and the
// convert of a Q6_K sum past 2^24).
//
// Numerics of the 32-value block types (llama.cpp's Q8_0 / Q8_1 activations): x is rounded the same way per block of
// 32 (its own s_b). A row's blocks go 8 at a time, one block per int32 lane: each weight row's 8 blocks are moved into
// lanes as they are read (nibble_lanes, Q8_0's 8 x 8 transpose; shared by the R activation rows) and x is prepared in
// the same lanes. Nibbles meet x unsigned (Q4_0 and Q5_0 as nibble and 5-bit value, their offsets 8 and 16 taken off
// as OFF * (sum of q) on the lane); their int16 pair sums (at most 2 * 31 * 127) add over 8 (Q5_0: 4) weight vectors
// before one vpmaddwd widens them; Q8_0's bytes meet x through vpsignb (|w| <= 128, pairs at most 2 * 128 * 127,
// never saturating), widened each. So per group of 8 blocks and row, one exact int32 sum per lane and
//     acc = fma(float(isum), d_l * s_l, acc)        (then, Q4_1: acc = fma(m_l, s_l * sum of q over block l, acc))
// The last K / 32 % 8 blocks of a row go one at a time (weights as signed bytes through vpsignb, Q4_1's nibbles as they
// are): isum over the block's 8 lanes, acc = fma(float(isum), d * s_b, acc), and for Q4_1 their mins on lanes 0..
// after them.
//
// Batch invariance, as in every variant (kernel_variant.h): an output y[r][n] is one fixed sequence of operations
// that depends only on (type, K, weight row n, activation row r): per super-block (group of 8 blocks, block) the
// integer sum (exact), one convert, one multiply (d * s), one fma, (Q4_K) one fnmadd, (Q4_1) one fma; in order; a
// fixed-tree sum of the 8 lanes. The tile (1 weight row x R <= 8 or 16 activation rows), the schedule and the thread
// never change it. Results are not the VNNI path's bits (that path scales x per block of 32 for every type, and
// differs in the order).
//
// 16-bit activations (the "avx2-int16" ops: the same functions with x8 false; Q4_K in either layout and Q6_K_R16, the
// 16-bit path of the Qwen2.5-Coder files on these CPUs, where avx2-fp32 had run every 16-bit product): each row is
// rounded to int16 per super-block of 256 (s = max|x| / 32639, as the VNNI kernels round per 32) and split into two
// signed bytes, q = 256 * hi + lo, so the same weight vectors meet each byte plane in vpmaddubsw (the high plane's
// int16 sums widened by 256 * sc, the low one's by sc, into the same exact int32 sums); the fp32 step as at int8
// (Q6_K_R16: per half, where its int32 sums stay exact). Twice the multiplies of int8 a row, none of avx2-fp32's
// conversions: on the 1.5B, Zen 3, 2 threads, decode 21.8 against 13.8 tok/s and r(8) 3.74 against 5.46 (`ultrafast
// agentbench`'s r(k)); tiles of up to LANE_ROWS16 rows (two sums a row in registers). The blocks of 32 (Q4_0, Q4_1,
// Q5_0, Q8_0) take 16-bit activations per block of 32 the same way, with q = 255 * hi + lo (Bp<2>, below).
//
// Compiled for the baseline ISA with a target pragma, entered only after avx2_usable(); no standard-library or
// torch header (see qmatmul_kernels.h).
#include "qmatmul_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#include <immintrin.h>

#define UF_INLINE inline __attribute__((always_inline))

namespace ultrafast {
namespace {

#include "simd_bytes.h"

// A prepared super-block (XSB bytes, rows ldx = nsb * XSB apart): int8 q[256] at 0; at XS (Q4_K), 8 floats s * (sum
// of q over sub-block j of 32), or at BS (Q6_K, the same place), 16 int16 sums of q over each scale group of 16; at S,
// the float s. (320 bytes where both sums had places of their own, 384: the down projection's x, K = 8960, is read
// from L2 at k >= 2, and its bytes are its time.)
// Xp<1>. With 16-bit activations (P = 2 byte planes, avx2-int16), Xp<2>: int16 q[256] as two signed byte planes, q =
// 256 * hi + lo, hi[256] at 0 and lo[256] at LO (each in the order the int8 q takes); at XS, Q4_K's 8 floats s * (sum
// of q over sub-block j), or at BS (Q6_K) 16 int32 sums of q over each scale group; at S the float s.
template <int P>
struct Xp {
  static constexpr int64_t SB = P == 1 ? 320 : 640, XS = P == 1 ? 256 : 512, BS = XS, S = P == 1 ? 288 : 576, LO = 256;
};
constexpr int64_t SBV = 256, XSB = Xp<1>::SB, XS = Xp<1>::XS, BS = Xp<1>::BS, S = Xp<1>::S;
constexpr int RMAX = 8;  // activation rows a tile of the K-quants in the file's layouts (their integer sums in
                         // registers, their accumulators as they fall; the lane layouts take LANE_ROWS); the block
                         // types take up to 2 * RMAX (their weights in lanes, made once a tile)

// The int8 scale of a block of x from its lanes' max |x| and NaN flags: s = max|x| / 127; NaN where the block holds a
// NaN, inf where it holds an inf, so that the row's outputs are non-finite too (as on every path); 0 where all are 0.
// (int_scale: the same for another largest integer, 32639 for int16.)
UF_INLINE float int_scale(__m256 mx, __m256 nan, float qmax) {
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm256_movemask_ps(nan) ? __builtin_nanf("") : _mm_cvtss_f32(m4) / qmax;
}

UF_INLINE float int8_scale(__m256 mx, __m256 nan) { return int_scale(mx, nan, 127.0f); }

// The scale of the super-block of 256 values at v for integers up to qmax (127: int8, 32639: int16).
UF_INLINE float super_block_scale(const float* v, float qmax) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int i = 0; i < SBV; i += 8) {
    const __m256 xv = _mm256_loadu_ps(v + i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, xv));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));  // max drops NaN: noted apart
  }
  return int_scale(mx, nan, qmax);
}

// Whether super-block b of a row of K values is read in lanes (the layout's comment below) and, to_lanes, 256 bytes of q
// in value order put in that lane order, in place.
UF_INLINE bool in_lanes(int layout, int64_t b, int64_t K) {
  return (layout == QT_Q4_K_R2 && b < K / 512 * 2) || layout == QT_Q6_K_R16;
}

void to_lanes(uint8_t* q, int layout) {
  uint32_t t[64];  // t[8 l + v]: values 4v..4v+3 of sub-block l (Q4_K) / of groups 2l, 2l + 1 (Q6_K: v < 4, >= 4)
  __builtin_memcpy(t, q, 256);
  uint32_t* d = reinterpret_cast<uint32_t*>(q);
  if (layout == QT_Q4_K_R2) {
    for (int v = 0; v < 8; ++v)
      for (int l = 0; l < 8; ++l) d[8 * v + l] = t[8 * l + v];
  } else {  // value 16 g + 4 v + j is t[4 g + v]'s byte j
    for (int h = 0; h < 2; ++h)
      for (int v = 0; v < 4; ++v)
        for (int l = 0; l < 8; ++l) d[8 * (4 * h + v) + l] = t[4 * (8 * h + l) + v];
  }
}

// layout: the type the rows hold. QT_Q4_K_R2: the first K / 512 * 2 super-blocks' q in the lane order of Q4_K's pairs: vector v (32 bytes),
// int32 lane l holds values 4v..4v+3 of sub-block l (an 8 x 8 transpose of the 32-bit pieces); the rest in value order.
// QT_Q6_K_R16: every super-block's q in its lane order: vector 4h + v, int32 lane l holds values 4v..4v+3 of scale
// group 8h + l (h = 0, 1; v = 0..3). Otherwise value order.
void prep_row(const float* x, int64_t K, uint8_t* out, int layout) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / SBV; ++b) {
    const float* v = x + b * SBV;
    uint8_t* o = out + b * XSB;
    const float s = super_block_scale(v, 127.0f);
    const __m256 sv = _mm256_set1_ps(s > 0.0f ? s : 1.0f);  // an all-zero super-block: q = 0
    for (int i = 0; i < SBV; i += 32) {  // rint(x / s) (the default rounding: to nearest even), int32 -> int8 in order
      __m256i a[4];
      for (int j = 0; j < 4; ++j) a[j] = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(v + i + 8 * j), sv));
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a[0], a[1]), _mm256_packs_epi32(a[2], a[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), _mm256_permutevar8x32_epi32(p, order));
    }
    const int8_t* q = reinterpret_cast<const int8_t*>(o);
    int16_t bs[16];
    for (int g = 0; g < 16; ++g) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += q[16 * g + i];
      bs[g] = (int16_t)sum;
    }
    if (layout == QT_Q6_K || layout == QT_Q6_K_R16) {
      __builtin_memcpy(o + BS, bs, 32);
    } else {
      float* xs = reinterpret_cast<float*>(o + XS);
      for (int j = 0; j < 8; ++j) xs[j] = s * (float)(bs[2 * j] + bs[2 * j + 1]);
    }
    __builtin_memcpy(o + S, &s, 4);
    if (in_lanes(layout, b, K)) to_lanes(o, layout);
  }
}

// 16-bit activations (avx2-int16): the row rounded to int16 per super-block of 256 as the VNNI kernels round theirs per
// block of 32, s = max|x| / 32639, q_i = rint(x_i / s) (q = 0 where max|x| = 0), and each q split into two signed bytes
// q = 256 * hi + lo (lo in -128..127, so |hi| <= 127), each plane in the byte order prep_row gives the int8 q of this
// layout (Xp<2>).
void prep_row16(const float* x, int64_t K, uint8_t* out, int layout) {
  using X = Xp<2>;
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i b128 = _mm256_set1_epi32(128), b255 = _mm256_set1_epi32(255);
  for (int64_t b = 0; b < K / SBV; ++b) {
    const float* v = x + b * SBV;
    uint8_t* o = out + b * X::SB;
    const float s = super_block_scale(v, 32639.0f);
    const __m256 sv = _mm256_set1_ps(s > 0.0f ? s : 1.0f);
    alignas(32) int32_t q[SBV];
    for (int i = 0; i < SBV; i += 32) {
      __m256i hi[4], lo[4];
      for (int j = 0; j < 4; ++j) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(v + i + 8 * j), sv));
        _mm256_store_si256(reinterpret_cast<__m256i*>(q + i + 8 * j), a);
        lo[j] = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(a, b128), b255), b128);
        hi[j] = _mm256_srai_epi32(_mm256_sub_epi32(a, lo[j]), 8);
      }
      const __m256i ph = _mm256_packs_epi16(_mm256_packs_epi32(hi[0], hi[1]), _mm256_packs_epi32(hi[2], hi[3]));
      const __m256i pl = _mm256_packs_epi16(_mm256_packs_epi32(lo[0], lo[1]), _mm256_packs_epi32(lo[2], lo[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), _mm256_permutevar8x32_epi32(ph, order));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + X::LO + i), _mm256_permutevar8x32_epi32(pl, order));
    }
    int64_t gs[16];  // sums of q over each group of 16 (64-bit: a NaN row's q are all INT32_MIN)
    for (int g = 0; g < 16; ++g) {
      int64_t sum = 0;
      for (int i = 0; i < 16; ++i) sum += q[16 * g + i];
      gs[g] = sum;
    }
    if (layout == QT_Q6_K_R16) {
      int32_t bs[16];
      for (int g = 0; g < 16; ++g) bs[g] = (int32_t)gs[g];
      __builtin_memcpy(o + X::BS, bs, 64);
    } else {
      float* xs = reinterpret_cast<float*>(o + X::XS);
      for (int j = 0; j < 8; ++j) xs[j] = s * (float)(gs[2 * j] + gs[2 * j + 1]);
    }
    __builtin_memcpy(o + X::S, &s, 4);
    if (in_lanes(layout, b, K)) {
      to_lanes(o, layout);
      to_lanes(o + X::LO, layout);
    }
  }
}

// A row of the 32-value block types, prepared: its nb / 8 whole groups of 8 blocks in lanes (LG bytes each), then, where
// nb % 8 != 0, the other blocks in block order (GB bytes). A group in lanes: 8 vectors of 32 bytes, vector v's int32
// lane l holding q values 4v..4v+3 of block l; at LS, 8 floats s_l; at LSS, 8 floats s_l * (sum of q over block l);
// at LSUM, 8 int32 sums of q. The last blocks: int8 q[256] (block j's at 32 j); at GS, 8 floats s_j; at GSS, 8 floats
// s_j * (sum of q over j) (0 past the row: read, as 0 * 0, by Q4_1's mins). Bp<1>.
// With 16-bit activations (avx2-int16), Bp<2>: x rounded to int16 per block of 32 with s = max|x| / 32385 and each q
// split into two signed bytes q = 255 * hi + lo, both in -127..127 (|x| <= 127 * 255 = 32385: Q8_0's weights meet x
// through vpsignb, which cannot negate -128); the high plane where the int8 q is, the low one LO bytes after it.
template <int P>
struct Bp {
  static constexpr int64_t LO = 256, LG = P == 1 ? 384 : 640, LS = P == 1 ? 256 : 512, LSS = LS + 32, LSUM = LS + 64,
                           GB = P == 1 ? 320 : 576, GS = LS, GSS = LS + 32;
  static constexpr float QMAX = P == 1 ? 127.0f : 32385.0f;
};
constexpr int64_t BV = 32, LG = Bp<1>::LG, LS = Bp<1>::LS, LSS = Bp<1>::LSS, LSUM = Bp<1>::LSUM, GB = Bp<1>::GB,
                  GS = Bp<1>::GS, GSS = Bp<1>::GSS;

template <int P>
UF_INLINE int64_t block_prep_bytes(int64_t K) {
  return K / BV / 8 * Bp<P>::LG + (K / BV % 8 != 0 ? Bp<P>::GB : 0);
}

template <int P>
void prep_blocks(const float* x, int64_t K, uint8_t* out) {
  using X = Bp<P>;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const int64_t nb = K / BV, whole = nb / 8 * 8;
  uint8_t* tail = out + nb / 8 * X::LG;
  if (nb != whole) __builtin_memset(tail + X::GS, 0, X::GB - X::GS);
  alignas(32) int8_t q[2][32];  // the int8 q (P = 1), or the high and low planes
  for (int64_t b = 0; b < nb; ++b) {
    const float* v = x + b * BV;
    __m256 xv[4], mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      xv[j] = _mm256_loadu_ps(v + 8 * j);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, xv[j]));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(xv[j], xv[j], _CMP_UNORD_Q));
    }
    const float s = int_scale(mx, nan, X::QMAX);
    const __m256 sv = _mm256_set1_ps(s > 0.0f ? s : 1.0f);
    __m256i a[4], hi[4];
    for (int j = 0; j < 4; ++j) a[j] = _mm256_cvtps_epi32(_mm256_div_ps(xv[j], sv));
    int64_t sum = 0;  // of q (64-bit: a NaN block's int16 q are all INT32_MIN)
    if (P == 2) {
      alignas(32) int32_t qi[32];
      for (int j = 0; j < 4; ++j) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(qi + 8 * j), a[j]);
        // hi = floor((q + 127) / 255) (exact in fp32: q + 127 <= 32512), lo = q - 255 hi in -127..127
        hi[j] = _mm256_cvtps_epi32(_mm256_floor_ps(_mm256_div_ps(
            _mm256_cvtepi32_ps(_mm256_add_epi32(a[j], _mm256_set1_epi32(127))), _mm256_set1_ps(255.0f))));
        a[j] = _mm256_sub_epi32(a[j], _mm256_mullo_epi32(hi[j], _mm256_set1_epi32(255)));
      }
      for (int i = 0; i < 32; ++i) sum += qi[i];
      const __m256i ph = _mm256_packs_epi16(_mm256_packs_epi32(hi[0], hi[1]), _mm256_packs_epi32(hi[2], hi[3]));
      _mm256_store_si256(reinterpret_cast<__m256i*>(q[0]), _mm256_permutevar8x32_epi32(ph, order));
    }
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a[0], a[1]), _mm256_packs_epi32(a[2], a[3]));
    _mm256_store_si256(reinterpret_cast<__m256i*>(q[P - 1]), _mm256_permutevar8x32_epi32(p, order));
    if (P == 1)
      for (int i = 0; i < 32; ++i) sum += q[0][i];
    const int32_t sum32 = (int32_t)sum;
    const float ss = s * (float)sum;
    if (b < whole) {
      uint8_t* o = out + b / 8 * X::LG;
      const int l = (int)(b & 7);
      for (int pl = 0; pl < P; ++pl)
        for (int vv = 0; vv < 8; ++vv) __builtin_memcpy(o + pl * X::LO + 32 * vv + 4 * l, q[pl] + 4 * vv, 4);
      __builtin_memcpy(o + X::LS + 4 * l, &s, 4);
      __builtin_memcpy(o + X::LSS + 4 * l, &ss, 4);
      __builtin_memcpy(o + X::LSUM + 4 * l, &sum32, 4);
    } else {
      const int j = (int)(b - whole);
      for (int pl = 0; pl < P; ++pl) __builtin_memcpy(tail + pl * X::LO + 32 * j, q[pl], 32);
      __builtin_memcpy(tail + X::GS + 4 * j, &s, 4);
      __builtin_memcpy(tail + X::GSS + 4 * j, &ss, 4);
    }
  }
}

// vpshufb masks that fill a 128-bit lane with int16 word w (the low lane: word lo, the high lane: word hi).
UF_INLINE __m256i word_mask(int lo, int hi) {
  return _mm256_setr_epi8(2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo,
                          2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * hi, 2 * hi + 1,
                          2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi,
                          2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1);
}

// Per super-block of a weight row, against R activation rows: the weight vectors are made one at a time and each meets
// the R rows' x before the next is made, so the R integer sums stay in registers beside it (16 ymm registers), summed
// as they are made. Measured on the 1.5B's w1 (8960 x 1536, Q4_K), k = 8, 1 thread (`int8_madd_peak`: ~100 G
// multiply-adds a second a core here): all eight vectors and their scales decoded first, then the rows, 45 G/s (they
// lived on the stack); one vector at a time, 53; with the sums kept from being regrouped (GCC made all 32 products
// first), 62; up to 8 rows a tile instead of 4 (the decode shared by twice the rows), 70 (Q6_K: 41, 48, 52, 60).

// A Q4_K header (p: d, dmin, then the 12 bytes of 6-bit scales and mins): the 8 scales as bytes in sc (2 words), and
// dmin * m_j on lane j (ggml's get_scale_min_k4, all eight at once).
struct Q4KHeader {
  uint32_t sc[2];
  __m256 dm;
  explicit UF_INLINE Q4KHeader(const uint8_t* p) {
    uint32_t s0, s1, s2;
    __builtin_memcpy(&s0, p + 4, 4);
    __builtin_memcpy(&s1, p + 8, 4);
    __builtin_memcpy(&s2, p + 12, 4);
    sc[0] = s0 & 0x3f3f3f3fu;
    sc[1] = (s2 & 0x0f0f0f0fu) | (((s0 >> 6) & 0x03030303u) << 4);
    const uint32_t m0 = s1 & 0x3f3f3f3fu;
    const uint32_t m1 = ((s2 >> 4) & 0x0f0f0f0fu) | (((s1 >> 6) & 0x03030303u) << 4);
    dm = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)m0, (int)m1, 0, 0))),
                       _mm256_set1_ps(h2f(p + 2)));
  }
  UF_INLINE __m128i scales() const { return _mm_setr_epi32((int)sc[0], (int)sc[1], 0, 0); }
  // The super-block's fp32 step for R rows (p: the header) from their exact int32 sums of sc_j * q_w . q_x:
  // acc += (d * s) * isum, then the mins: acc -= (dmin * m_j) * (s * sum of q over sub-block j).
  template <int R, int P = 1>
  UF_INLINE void fp_step(const uint8_t* p, const uint8_t* xb, int64_t ldx, const __m256i* isum, __m256* acc) const {
    const __m256 d = _mm256_set1_ps(h2f(p));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const uint8_t* x = xb + r * ldx;
      const __m256 t = _mm256_mul_ps(d, _mm256_broadcast_ss(reinterpret_cast<const float*>(x + Xp<P>::S)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), t, acc[r]);
      acc[r] = _mm256_fnmadd_ps(dm, _mm256_loadu_ps(reinterpret_cast<const float*>(x + Xp<P>::XS)), acc[r]);
    }
  }
};

// Q4_K (144 bytes: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles: 32-byte chunk c holds values
// 64c..64c+31 in its low nibbles (sub-block 2c) and 64c+32..64c+63 in its high ones (sub-block 2c+1)).
template <int P>
struct Q4KP {
  static constexpr int64_t BYTES = 144;
  static constexpr bool PAIRED = false;
  static constexpr int PLANES = P;
  template <int R>
  static UF_INLINE void super_block(const uint8_t* p, const uint8_t* xb, int64_t ldx, __m256* acc) {
    const Q4KHeader hdr(p);
    const __m128i sc16 = _mm_cvtepu8_epi16(hdr.scales());
    const __m256i scw = _mm256_set_m128i(sc16, sc16);  // sc_0..7 as int16 in both lanes
    const __m256i scw256 = _mm256_slli_epi16(scw, 8);  // 256 * sc (at most 16128): the high byte plane's (P = 2)
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    __m256i sum[R];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i Q = load256(p + 16 + 32 * c);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // sub-block j = 2c + h
        const int j = 2 * c + h;
        const __m256i w = _mm256_and_si256(h ? _mm256_srli_epi16(Q, 4) : Q, m0f);
        const __m256i sc = _mm256_shuffle_epi8(P == 1 ? scw : scw256, word_mask(j, j));
        const __m256i scl = _mm256_shuffle_epi8(scw, word_mask(j, j));
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const uint8_t* x = xb + r * ldx + 32 * j;
          __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(w, load256(x)), sc);
          if (P == 2) t = _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_maddubs_epi16(w, load256(x + Xp<P>::LO)), scl));
          sum[r] = j == 0 ? t : _mm256_add_epi32(sum[r], t);
          __asm__("" : "+x"(sum[r]));  // summed as made: left free, GCC keeps all 32 products on the stack first
        }
      }
    }
    hdr.fp_step<R, P>(p, xb, ldx, sum, acc);
  }
};
using Q4K = Q4KP<1>;

// Q4_K in the VNNI kernels' pairs of super-blocks (QT_Q4_K_R2, made at load by qmm_repack_vnni; qmatmul_vnni.cpp's
// KQ4K2): 288 bytes, the two 16-byte headers as in the file, then 4 chunks u of 64 bytes whose first 32 bytes hold
// super-block 0's nibbles and the other 32 super-block 1's: byte 4l + j holds value 8u + j of sub-block l (low nibble,
// weight vector 2u) and 8u + 4 + j (high, vector 2u + 1). One sub-block per int32 lane, so a row's 8 products of a
// super-block add as int16 (at most 8 * 2 * 15 * 127 = 30480: exact) and one vpmaddwd by the lanes' scales widens them:
// 9 multiplies per 256 values and row where the file's layout takes 16 (its sub-blocks span whole vectors).
// 16-bit activations (P = 2): each plane's int16 sums as above (at most 8 * 2 * 15 * 128), widened by 256 * sc_l (the
// high plane) and sc_l: the lane's exact sc_l * (q_w . q_x), at most 63 * 32 * 15 * 32639 < 2^31.
template <int P>
struct Q4K2P {
  static constexpr int64_t BYTES = 288;  // a pair
  static constexpr bool PAIRED = true;
  static constexpr int PLANES = P;
  using Tail = Q4KP<P>;  // an odd last super-block, in the file's layout
  template <int R>
  static UF_INLINE void half(const uint8_t* p, int h, const uint8_t* xb, int64_t ldx, __m256* acc) {
    const uint8_t* hd = p + 16 * h;
    const Q4KHeader hdr(hd);
    const __m256i sc32 = _mm256_cvtepu8_epi32(hdr.scales());
    const __m256i scw = _mm256_or_si256(sc32, _mm256_slli_epi32(sc32, 16));  // sc_l in both words of lane l
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    __m256i sum[R], lo[P == 2 ? R : 1];
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      const __m256i Q = load256(p + 32 + 64 * u + 32 * h);
#pragma GCC unroll 2
      for (int hi = 0; hi < 2; ++hi) {
        const int v = 2 * u + hi;
        const __m256i w = _mm256_and_si256(hi ? _mm256_srli_epi16(Q, 4) : Q, m0f);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const uint8_t* x = xb + r * ldx + 32 * v;
          const __m256i t = _mm256_maddubs_epi16(w, load256(x));
          sum[r] = v == 0 ? t : _mm256_add_epi16(sum[r], t);
          __asm__("" : "+x"(sum[r]));
          if constexpr (P == 2) {
            const __m256i tl = _mm256_maddubs_epi16(w, load256(x + Xp<P>::LO));
            lo[r] = v == 0 ? tl : _mm256_add_epi16(lo[r], tl);
            __asm__("" : "+x"(lo[r]));
          }
        }
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {  // widened: sc_l * (q_w . q_x) on lane l
      if constexpr (P == 1) {
        sum[r] = _mm256_madd_epi16(sum[r], scw);
      } else {
        sum[r] = _mm256_add_epi32(_mm256_madd_epi16(sum[r], _mm256_slli_epi16(scw, 8)), _mm256_madd_epi16(lo[r], scw));
      }
    }
    hdr.fp_step<R, P>(hd, xb, ldx, sum, acc);
  }
};
using Q4K2 = Q4K2P<1>;

// Q6_K (210 bytes: ql[128], qh[64], 16 int8 scales, d). Half h (values 128h..128h+127) reads ql + 64h and qh + 32h:
// value 128h + 32c + l (l < 32) is (ql[l + 32 (c & 1)] >> 4 (c >> 1)) & 15 | ((qh[l] >> 2c) & 3) << 4; scale group
// of value i: i / 16, so weight vector m = 4h + c holds groups 2m (its low lane) and 2m + 1 (its high lane).
struct Q6K {
  static constexpr int64_t BYTES = 210;
  static constexpr bool PAIRED = false;
  static constexpr int PLANES = 1;
  template <int R>
  static UF_INLINE void super_block(const uint8_t* p, const uint8_t* xb, int64_t ldx, __m256* acc) {
    const __m256i m0f = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    __m256i sum[R];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i L0 = load256(p + 64 * h), L1 = load256(p + 64 * h + 32), H = load256(p + 128 + 32 * h);
      // the 8 scales of this half as int16, in both lanes
      const __m128i s8 = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 192 + 8 * h)));
      const __m256i scw = _mm256_set_m128i(s8, s8);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const int m = 4 * h + c;
        const __m256i L = c & 1 ? L1 : L0;
        const __m256i lo = _mm256_and_si256(c >> 1 ? _mm256_srli_epi16(L, 4) : L, m0f);
        const __m256i hb = c == 0 ? _mm256_slli_epi16(H, 4) : c == 1 ? _mm256_slli_epi16(H, 2)
                         : c == 2 ? H : _mm256_srli_epi16(H, 2);
        const __m256i w = _mm256_or_si256(lo, _mm256_and_si256(hb, m30));
        const __m256i sc = _mm256_shuffle_epi8(scw, word_mask(2 * c, 2 * c + 1));
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(w, load256(xb + r * ldx + 32 * m)), sc);
          sum[r] = m == 0 ? t : _mm256_add_epi32(sum[r], t);
          __asm__("" : "+x"(sum[r]));
        }
      }
    }
    fp_step<R>(p, xb, ldx, sum, acc);
  }

  // A super-block's fp32 step (the scales at p + 192 and d at p + 208 in the file's layout and in Q6KR's): per row the
  // -32 offset, 32 * sum_g sc_g * (sum of x over group g), taken off the integer sum (exact), then one convert and fma.
  template <int R>
  static UF_INLINE void fp_step(const uint8_t* p, const uint8_t* xb, int64_t ldx, const __m256i* isum, __m256* acc) {
    const __m256i sc16 = _mm256_cvtepi8_epi16(load128(p + 192));
    const __m256 d = _mm256_set1_ps(h2f(p + 208));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const uint8_t* x = xb + r * ldx;
      const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(sc16, load256(x + BS)), 5);
      const __m256 t = _mm256_mul_ps(d, _mm256_broadcast_ss(reinterpret_cast<const float*>(x + S)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[r], off)), t, acc[r]);
    }
  }
};

// Q6_K in the VNNI kernels' layout (QT_Q6_K_R16, made at load by qmm_repack_vnni; qmatmul_vnni.cpp's KQ6KR): 210
// bytes, one scale group of 16 values per int32 lane of a 64-byte chunk, whose first 32 bytes hold groups 0..7 (half
// h = 0) and the other 32 groups 8..15: the low nibbles in chunks 0 and 1 (byte 4l + j of chunk c: value 8c + j of
// the group in its low nibble, 8c + 4 + j in its high one: weight vectors 2c, 2c + 1), the high two bits in chunk 2
// (byte 4l + j, bits 2v..2v + 1: value 4v + j), then the 16 int8 scales in group order and d. A weight vector's int16
// pair sums (at most 2 * 63 * 127) add two at a time, exact, before one vpmaddwd by the lanes' scales: 12 multiplies
// per 256 values and row where the file's layout takes 16, and no scale shuffles. The -32 offset as in Q6K.
// 16-bit activations (P = 2): each plane's pair of vectors as above, widened by 256 * sc (the high plane; -32768 ..
// 32512 fits a word) and sc into one int32 per lane, and each half's fp32 step on its own, the -32 offset taken off
// first as 32 * sc_g * (sum of q over group g) (BS: int32 sums): the lane's sc_g * ((q_w - 32) . q_x) is exact, at
// most 128 * 16 * 32 * 32640 < 2^31, where the sums of the two halves could pass 2^31.
template <int P>
struct Q6KRP : Q6K {  // the file's bytes per super-block, and its fp32 step
  static constexpr int PLANES = P;
  template <int R>
  static UF_INLINE void super_block(const uint8_t* p, const uint8_t* xb, int64_t ldx, __m256* acc) {
    const __m256i m0f = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m128i sc8 = load128(p + 192);
    const __m256 d = _mm256_set1_ps(h2f(p + 208));
    __m256i isum[R];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i sc32 = _mm256_cvtepi8_epi32(h ? _mm_srli_si128(sc8, 8) : sc8);
      const __m256i scw = _mm256_blend_epi16(sc32, _mm256_slli_epi32(sc32, 16), 0xAA);  // sc in both words of a lane
      const __m256i H = load256(p + 128 + 32 * h);
#pragma GCC unroll 2
      for (int c = 0; c < 2; ++c) {
        const __m256i L = load256(p + 64 * c + 32 * h);
        // vectors 2c and 2c + 1: the high bits of value 4v + j at bits 2v..2v + 1 of H, moved to bits 4..5
        const __m256i ha = c ? H : _mm256_slli_epi16(H, 4);
        const __m256i hb = c ? _mm256_srli_epi16(H, 2) : _mm256_slli_epi16(H, 2);
        const __m256i wa = _mm256_or_si256(_mm256_and_si256(L, m0f), _mm256_and_si256(ha, m30));
        const __m256i wb = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L, 4), m0f), _mm256_and_si256(hb, m30));
        const int v = 4 * h + 2 * c;
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const uint8_t* x = xb + r * ldx + 32 * v;
          const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(wa, load256(x)), _mm256_maddubs_epi16(wb, load256(x + 32)));
          __m256i m;
          if constexpr (P == 1) {
            m = _mm256_madd_epi16(t, scw);
          } else {
            const uint8_t* xl = x + Xp<P>::LO;
            const __m256i tl = _mm256_add_epi16(_mm256_maddubs_epi16(wa, load256(xl)),
                                                _mm256_maddubs_epi16(wb, load256(xl + 32)));
            m = _mm256_add_epi32(_mm256_madd_epi16(t, _mm256_slli_epi16(scw, 8)), _mm256_madd_epi16(tl, scw));
          }
          isum[r] = (P == 1 ? v == 0 : c == 0) ? m : _mm256_add_epi32(isum[r], m);
          __asm__("" : "+x"(isum[r]));
        }
      }
      if constexpr (P == 2) {  // this half's fp32 step
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const uint8_t* x = xb + r * ldx;
          const __m256i off = _mm256_slli_epi32(_mm256_mullo_epi32(sc32, load256(x + Xp<P>::BS + 32 * h)), 5);
          const __m256 t = _mm256_mul_ps(d, _mm256_broadcast_ss(reinterpret_cast<const float*>(x + Xp<P>::S)));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[r], off)), t, acc[r]);
        }
      }
    }
    if constexpr (P == 1) Q6K::fp_step<R>(p, xb, ldx, isum, acc);
  }
};
using Q6KR = Q6KRP<1>;

// The 32-value block types. T::weights(p): a block's 32 weights as bytes in value order, signed integers (SIGNED) or
// Q4_1's unsigned nibbles (the last nb % 8 blocks of a row). T::lanes(p, W): 8 blocks' weights (p: the first; BYTES
// apart) in lanes, W[v]'s int32 lane l holding values 4v..4v+3 of block l: unsigned (Q4_0 and Q5_0 offset by 8 and 16,
// OFF) or, Q8_0, signed. T::BYTES a block's size; the fp16 d at p.
UF_INLINE __m256i nibbles(const uint8_t* q) {  // 16 bytes: values 0..15 in the low nibbles, 16..31 in the high ones
  const __m128i v = load128(q);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

// The 16 bytes at q + 0, q + BB, ..., q + 7 BB (8 blocks' nibbles) in lanes: Q[t]'s int32 lane l = bytes 4t..4t+3 of
// block l, split into W[t] (their low nibbles: values 4t..4t+3) and W[t + 4] (high: values 16 + 4t..16 + 4t + 3).
template <int64_t BB>
UF_INLINE void nibble_lanes(const uint8_t* q, __m256i* W) {
  const __m256i a = _mm256_set_m128i(load128(q + 4 * BB), load128(q));
  const __m256i b = _mm256_set_m128i(load128(q + 5 * BB), load128(q + BB));
  const __m256i c = _mm256_set_m128i(load128(q + 6 * BB), load128(q + 2 * BB));
  const __m256i d = _mm256_set_m128i(load128(q + 7 * BB), load128(q + 3 * BB));
  const __m256i t0 = _mm256_unpacklo_epi32(a, b), t1 = _mm256_unpackhi_epi32(a, b);
  const __m256i t2 = _mm256_unpacklo_epi32(c, d), t3 = _mm256_unpackhi_epi32(c, d);
  const __m256i Q[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2), _mm256_unpacklo_epi64(t1, t3),
                        _mm256_unpackhi_epi64(t1, t3)};
  const __m256i m0f = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
  for (int t = 0; t < 4; ++t) {
    W[t] = _mm256_and_si256(Q[t], m0f);
    W[t + 4] = _mm256_and_si256(_mm256_srli_epi16(Q[t], 4), m0f);
  }
}

// n <= 8 fp16 values at p + off, p + BB + off, ...: fp32 on lanes 0..n-1, 0 on the others.
template <int64_t BB>
UF_INLINE __m256 halves8(const uint8_t* p, int off, int64_t n = 8) {
  uint16_t h[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma GCC unroll 8
  for (int64_t l = 0; l < n; ++l) __builtin_memcpy(&h[l], p + l * BB + off, 2);
  return _mm256_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], (short)h[4], (short)h[5],
                                        (short)h[6], (short)h[7]));
}

struct Q4_0B {  // d, 16 bytes of nibbles; w = nibble - 8
  static constexpr int64_t BYTES = 18;
  static constexpr bool SIGNED = true, MINS = false;
  static constexpr int OFF = 8, SPAN = 8;  // SPAN: lane vectors whose int16 pair sums add without overflow
  static UF_INLINE __m256i weights(const uint8_t* p) { return _mm256_sub_epi8(nibbles(p + 2), _mm256_set1_epi8(8)); }
  static UF_INLINE void lanes(const uint8_t* p, __m256i* W) { nibble_lanes<BYTES>(p + 2, W); }
};

struct Q4_1B {  // d, m, 16 bytes of nibbles; w = d * nibble + m
  static constexpr int64_t BYTES = 20;
  static constexpr bool SIGNED = false, MINS = true;
  static constexpr int OFF = 0, SPAN = 8;
  static UF_INLINE __m256i weights(const uint8_t* p) { return nibbles(p + 4); }
  static UF_INLINE void lanes(const uint8_t* p, __m256i* W) { nibble_lanes<BYTES>(p + 4, W); }
};

struct Q5_0B {  // d, 32 high bits (bit i: value i's), 16 bytes of nibbles; w = (nibble | high << 4) - 16
  static constexpr int64_t BYTES = 22;
  static constexpr bool SIGNED = true, MINS = false;
  static constexpr int OFF = 16, SPAN = 4;  // values up to 31: 4 vectors' pairs, 4 * 2 * 31 * 127 < 2^15
  static UF_INLINE __m256i weights(const uint8_t* p) {
    uint32_t qh;
    __builtin_memcpy(&qh, p + 2, 4);
    // byte i of qh's copy: byte i / 8 of qh (vpshufb stays in each 128-bit lane; every lane holds qh), then bit i % 8
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)qh),
        _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i high = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    // high set: the nibble (0..15); clear: nibble - 16, whose byte is the nibble with 0xF0 set
    return _mm256_or_si256(nibbles(p + 6), _mm256_andnot_si256(high, _mm256_set1_epi8((char)0xF0)));
  }
  static UF_INLINE void lanes(const uint8_t* p, __m256i* W) {
    nibble_lanes<BYTES>(p + 6, W);
    uint32_t qh[8];
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) __builtin_memcpy(&qh[l], p + l * BYTES + 2, 4);
    const __m256i H = _mm256_setr_epi32((int)qh[0], (int)qh[1], (int)qh[2], (int)qh[3], (int)qh[4], (int)qh[5],
                                        (int)qh[6], (int)qh[7]);
    const __m256i b16 = _mm256_set1_epi8(0x10);
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) {  // values 4v..4v+3: bits 4v..4v+3 of qh, in its byte v / 2
      const char k = (char)(v / 2), k4 = (char)(4 + v / 2), k8 = (char)(8 + v / 2), k12 = (char)(12 + v / 2);
      const __m256i spread = _mm256_shuffle_epi8(
          H, _mm256_setr_epi8(k, k, k, k, k4, k4, k4, k4, k8, k8, k8, k8, k12, k12, k12, k12, k, k, k, k, k4, k4, k4, k4,
                              k8, k8, k8, k8, k12, k12, k12, k12));
      const __m256i bit = _mm256_set1_epi32(v & 1 ? (int)0x80402010 : 0x08040201);
      W[v] = _mm256_or_si256(W[v], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), b16));
    }
  }
};

struct Q8_0B {  // d, 32 int8
  static constexpr int64_t BYTES = 34;
  static constexpr bool SIGNED = true, MINS = false;
  static constexpr int OFF = 0, SPAN = 1;
  static UF_INLINE __m256i weights(const uint8_t* p) { return load256(p + 2); }
  static UF_INLINE void lanes(const uint8_t* p, __m256i* W) {  // an 8 x 8 transpose of int32 pieces
    __m256i r[8];
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) r[l] = load256(p + l * BYTES + 2);
    __m256i t[8], u[8];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) {
      u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
      u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    // u[j] (j < 4): dword j of blocks 0..3 (low lane: of their low halves, high lane: high halves); u[4 + j]: blocks 4..7
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      W[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
      W[j + 4] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
    }
  }
};

// Every linear's tile: one weight row against R activation rows, with the R accumulators in registers up to
// ACC_IN_REGS rows and in memory (L1) above: a tile of 9 or 10 rows keeps its integer sums in registers (10 of the 16)
// and each accumulator costs a load and a store per super-block. T::row<R>. The K-quants: T::super_block<R> per
// super-block, or (T::PAIRED, Q4K2) T::half<R> for each half of a pair, an odd last super-block in the file's layout
// (Q4K).
constexpr int ACC_IN_REGS = 8;

// After a super-block (or half) of a tile of R rows: above ACC_IN_REGS rows the accumulators go to memory here (the
// barrier takes their address), so that the integer sums keep the registers.
template <int R, int P = 1>
UF_INLINE void accumulators_to_l1(__m256* acc) {
  if constexpr (R * P > ACC_IN_REGS) __asm__ volatile("" : : "r"(acc) : "memory");
}

template <class T, int ROWS_ = RMAX>
struct SuperBlocks {  // Q4_K, Q6_K, and their layouts: units of 256 values
  static constexpr int64_t VALUES = SBV;
  static constexpr int ROWS = ROWS_;
  template <int R>
  __attribute__((noinline)) static void row(const uint8_t* __restrict p, int64_t nsb, const uint8_t* __restrict xg,
                                            int64_t ldx, float* y, int64_t ldy) {
    constexpr int PL = T::PLANES;
    constexpr int64_t SB = Xp<PL>::SB;
    __m256 acc[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    if constexpr (T::PAIRED) {
      const int64_t np = nsb / 2;
      for (int64_t P = 0; P < np; ++P) {
        T::template half<R>(p + P * T::BYTES, 0, xg + 2 * P * SB, ldx, acc);
        accumulators_to_l1<R, PL>(acc);
        T::template half<R>(p + P * T::BYTES, 1, xg + (2 * P + 1) * SB, ldx, acc);
        accumulators_to_l1<R, PL>(acc);
      }
      if (nsb % 2) T::Tail::template super_block<R>(p + np * T::BYTES, xg + 2 * np * SB, ldx, acc);
    } else {
      for (int64_t b = 0; b < nsb; ++b) {
        T::template super_block<R>(p + b * T::BYTES, xg + b * SB, ldx, acc);
        accumulators_to_l1<R, PL>(acc);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) y[r * ldy] = hsum8(acc[r]);
  }
};

// The lane layouts (Q4_K's pairs, Q6_K_R16) take tiles of up to 10 rows, so that ten rows (best-of-10's candidates, a
// verification of ten) decode each weight row once instead of twice. Before: Q4_K tiles of 8 (k = 7 and 8 one chunk:
// `bench` on the 1.5B at int8, alternated, r(7) 2.17 and 1.70 against 2.44 and 2.70 with tiles of 6), Q6_K 6. Tiles
// of 10 first ran at 50 G MAC/s: the loops over rows were unrolled 8 at a time, so GCC kept the sums in an array on
// the stack; unrolled whole, with the accumulators in memory (ACC_IN_REGS), ten rows of the 1.5B took 106 ms against
// 113-116 (k = 8: 85 against 89-91; a script timing `Engine.forward_batch` of k one-token sequences, alternated with
// the build before, three pairs). The outputs are the same bits at any tile.
constexpr int LANE_ROWS = 10;
// 16-bit activations keep two int16 sums a row (the byte planes): tiles of up to LANE_ROWS16 rows.
constexpr int LANE_ROWS16 = 4;

// P = 2 (16-bit activations): each row's plane sums as above, high and low, made into one exact int32 sum per lane,
// 255 * high + low (at most 32 * 128 * 32385 < 2^31), before the offsets and the same fp32 step.
template <class T, int P = 1>
struct Blocks {  // Q4_0, Q4_1, Q5_0, Q8_0: units of 32 values
  static constexpr int64_t VALUES = BV;
  static constexpr int ROWS = 2 * RMAX;
  using X = Bp<P>;

  // 255 * hi + lo, exact
  static UF_INLINE __m256i planes(__m256i hi, __m256i lo) {
    return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(hi, 8), hi), lo);
  }

  // One plane of a row's lane group (x: its 8 vectors) against the group's weights: per lane, the exact int32 sum of
  // the block's products (without Q4_0's and Q5_0's offsets).
  static UF_INLINE __m256i plane_sum(const uint8_t* x, const __m256i* W, const __m256i* A) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i isum = _mm256_setzero_si256();
    if (T::SPAN == 1) {
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) {
        const __m256i xv = _mm256_sign_epi8(load256(x + 32 * v), W[v]);
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(A[v], xv), ones));
      }
    } else {
#pragma GCC unroll 2
      for (int v0 = 0; v0 < 8; v0 += T::SPAN) {
        __m256i s16 = _mm256_maddubs_epi16(W[v0], load256(x + 32 * v0));
#pragma GCC unroll 8
        for (int v = v0 + 1; v < v0 + T::SPAN; ++v)
          s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(W[v], load256(x + 32 * v)));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(s16, ones));
      }
    }
    return isum;
  }

  // A whole group of 8 blocks (p: its first) against the R rows' lane groups (xg, ldx apart): per row the int32 sum of
  // each block on its lane (exact: int16 pair sums added SPAN vectors at a time, then widened), one convert and one
  // fma with d_l * s_l; Q4_1 then its mins, Q4_0 and Q5_0 their offsets in the integer sum.
  template <int R>
  static UF_INLINE void group(const uint8_t* p, const uint8_t* xg, int64_t ldx, __m256* acc) {
    alignas(32) __m256i W[8], A[8];
    T::lanes(p, W);
    if (T::SPAN == 1) {  // Q8_0: |w| beside w (x takes w's sign)
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) A[v] = _mm256_abs_epi8(W[v]);
    }
    const __m256 d = halves8<T::BYTES>(p, 0);
    const __m256 m = T::MINS ? halves8<T::BYTES>(p, 2) : _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const uint8_t* x = xg + r * ldx;
      __m256i isum = plane_sum(x, W, A);
      if (P == 2) isum = planes(isum, plane_sum(x + X::LO, W, A));
      if (T::OFF != 0)  // OFF * (sum of q) on each block's lane (OFF = 8 or 16)
        isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(load256(x + X::LSUM), T::OFF == 8 ? 3 : 4));
      const __m256 ds = _mm256_mul_ps(d, _mm256_loadu_ps(reinterpret_cast<const float*>(x + X::LS)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), ds, acc[r]);
      if (T::MINS) acc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(reinterpret_cast<const float*>(x + X::LSS)), acc[r]);
    }
  }

  template <int R>
  __attribute__((noinline)) static void row(const uint8_t* __restrict p, int64_t nb, const uint8_t* __restrict xg,
                                            int64_t ldx, float* y, int64_t ldy) {
    __m256 acc[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const int64_t whole = nb / 8 * 8;
    for (int64_t g = 0; g < whole / 8; ++g) group<R>(p + 8 * g * T::BYTES, xg + g * X::LG, ldx, acc);
    // the last nb % 8 blocks, one at a time
    const uint8_t* xt = xg + whole / 8 * X::LG;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = whole; b < nb; ++b) {
      const uint8_t* blk = p + b * T::BYTES;
      const __m256i w = T::weights(blk);
      const __m256i uw = T::SIGNED ? _mm256_abs_epi8(w) : w;
      const __m256 d = _mm256_set1_ps(h2f(blk));
      const uint8_t* xq = xt + 32 * (b - whole);
      const float* xs = reinterpret_cast<const float*>(xt + X::GS + 4 * (b - whole));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        __m256i t[P];
#pragma GCC unroll 2
        for (int pl = 0; pl < P; ++pl) {
          __m256i xv = load256(xq + r * ldx + pl * X::LO);
          if (T::SIGNED) xv = _mm256_sign_epi8(xv, w);
          t[pl] = _mm256_madd_epi16(_mm256_maddubs_epi16(uw, xv), ones);
        }
        const __m256i it = P == 2 ? planes(t[0], t[P - 1]) : t[0];
        const __m256 ds = _mm256_mul_ps(d, _mm256_broadcast_ss(xs + r * (ldx / 4)));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(it), ds, acc[r]);
        __asm__("" : "+x"(acc[r]));
      }
    }
    if (T::MINS && whole < nb) {  // their mins, m_j * (s_j * sum of q), block whole + j's on lane j
      const __m256 m = halves8<T::BYTES>(p + whole * T::BYTES, 2, nb - whole);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(reinterpret_cast<const float*>(xt + X::GSS + r * ldx)), acc[r]);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) y[r * ldy] = hsum8(acc[r]);
  }
};

// U::row<rr> (1 <= rr <= U::ROWS): a function of its own for each tile height (the registers it keeps).
template <class U, int R = 1>
void run_rows(const uint8_t* p, int64_t nu, const uint8_t* xg, int64_t ldx, int64_t rr, float* y, int64_t ldy) {
  if constexpr (R < U::ROWS) {
    if (rr > R) return run_rows<U, R + 1>(p, nu, xg, ldx, rr, y, ldy);
  }
  U::template row<R>(p, nu, xg, ldx, y, ldy);
}

// Weight rows [n0, n1) against the k prepared rows (ldx bytes apart), in chunks of U::ROWS activation rows as even as
// they can be. Few rows (decode, verification): each weight row is read once from memory and then met by every chunk
// (it stays in L1). More (prefill): tiles of weight rows of ~128 KB, read from memory once and kept in L2, each swept
// by every chunk. Both schedules give every output the same operations.
template <class U>
void rows_impl(const uint8_t* xg, int64_t k, int64_t K, int64_t ldx, const uint8_t* w, int64_t rb, float* y,
               int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nu = K / U::VALUES;
  const int64_t nch = (k + U::ROWS - 1) / U::ROWS, per = (k + nch - 1) / nch;
  int64_t tile = (128 * 1024) / (rb > 0 ? rb : 1);
  if (tile < 1) tile = 1;
  if (k <= 2 * U::ROWS) tile = n1 - n0;
  for (int64_t nt = n0; nt < n1; nt += tile) {
    const int64_t ne = nt + tile < n1 ? nt + tile : n1;
    if (k <= 2 * U::ROWS) {
      for (int64_t n = nt; n < ne; ++n)
        for (int64_t r0 = 0; r0 < k; r0 += per)
          run_rows<U>(w + n * rb, nu, xg + r0 * ldx, ldx, k - r0 < per ? k - r0 : per, y + r0 * ldy + n, ldy);
    } else {
      for (int64_t r0 = 0; r0 < k; r0 += per)
        for (int64_t n = nt; n < ne; ++n)
          run_rows<U>(w + n * rb, nu, xg + r0 * ldx, ldx, k - r0 < per ? k - r0 : per, y + r0 * ldy + n, ldy);
    }
  }
}

bool super_block_type(int qtype) {
  return qtype == QT_Q4_K || qtype == QT_Q6_K || qtype == QT_Q4_K_R2 || qtype == QT_Q6_K_R16;
}

}  // namespace

int64_t avx2_madd_chains(int64_t n) {
  // The lanes' arithmetic (Q4K2, Q6KR, the block types): per chain, vpmaddubsw products summed as int16 by vpaddw, one
  // vpmaddwd by the scales and a vpaddd per 8 of them. 6 chains; 12 vpmaddubsw per unit of n (n rounded up to 4).
  __m256i acc[6], s16[6];
#pragma GCC unroll 6
  for (int i = 0; i < 6; ++i) acc[i] = _mm256_set1_epi32(i);
  __m256i x = _mm256_set1_epi8(-3);
  const __m256i w = _mm256_set1_epi8(7), sc = _mm256_set1_epi16(5);
  for (int64_t i = 0; i < n; i += 4) {
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) {
#pragma GCC unroll 6
      for (int j = 0; j < 6; ++j) {
        __asm__("" : "+x"(x));  // every step's products are made anew (not hoisted, not shared between chains)
        const __m256i t = _mm256_maddubs_epi16(w, x);
        s16[j] = v == 0 ? t : _mm256_add_epi16(s16[j], t);
        __asm__("" : "+x"(s16[j]));  // summed as made (as in the kernels), not all products first
      }
    }
#pragma GCC unroll 6
    for (int j = 0; j < 6; ++j) acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(s16[j], sc));
  }
  for (int j = 1; j < 6; ++j) acc[0] = _mm256_add_epi32(acc[0], acc[j]);
  return _mm256_extract_epi32(acc[0], 0);
}

bool qmm_avx2_int8_supports(int qtype) {
  return super_block_type(qtype) || qtype == QT_Q4_0 || qtype == QT_Q4_1 || qtype == QT_Q5_0 || qtype == QT_Q8_0;
}

bool qmm_avx2_int16_supports(int qtype) {
  return qtype == QT_Q4_K || qtype == QT_Q4_K_R2 || qtype == QT_Q6_K_R16 || qtype == QT_Q4_0 || qtype == QT_Q4_1 ||
         qtype == QT_Q5_0 || qtype == QT_Q8_0;
}

int64_t qmm_prep_bytes_avx2_int8(int qtype, int64_t K, bool x8) {
  if (super_block_type(qtype)) return (K + SBV - 1) / SBV * (x8 ? XSB : Xp<2>::SB);
  return x8 ? block_prep_bytes<1>(K) : block_prep_bytes<2>(K);
}

int64_t qmm_prep_units_avx2_int8(int, int64_t) { return 1; }

void qmm_prep_avx2_int8(int qtype, const float* x, int64_t K, uint8_t* xg, int64_t u0, int64_t u1, bool x8) {
  if (u0 >= u1) return;
  if (!super_block_type(qtype))
    x8 ? prep_blocks<1>(x, K, xg) : prep_blocks<2>(x, K, xg);
  else if (x8)
    prep_row(x, K, xg, qtype);
  else
    prep_row16(x, K, xg, qtype);
}

bool qmm_rows_avx2_int8(int qtype, const uint8_t* xg, int64_t k, int64_t K, const uint8_t* w, int64_t rb, float* y,
                        int64_t ldy, int64_t n0, int64_t n1, bool x8) {
  const int64_t ldx = qmm_prep_bytes_avx2_int8(qtype, K, x8);
  if (K % (super_block_type(qtype) ? SBV : BV) != 0) return false;
  if (!x8) {
    switch (qtype) {
      case QT_Q4_K: rows_impl<SuperBlocks<Q4KP<2>, LANE_ROWS16>>(xg, k, K, ldx, w, rb, y, ldy, n0, n1); return true;
      case QT_Q4_K_R2: rows_impl<SuperBlocks<Q4K2P<2>, LANE_ROWS16>>(xg, k, K, ldx, w, rb, y, ldy, n0, n1); return true;
      case QT_Q6_K_R16: rows_impl<SuperBlocks<Q6KRP<2>, LANE_ROWS16>>(xg, k, K, ldx, w, rb, y, ldy, n0, n1); return true;
      case QT_Q4_0: rows_impl<Blocks<Q4_0B, 2>>(xg, k, K, ldx, w, rb, y, ldy, n0, n1); return true;
      case QT_Q4_1: rows_impl<Blocks<Q4_1B, 2>>(xg, k, K, ldx, w, rb, y, ldy, n0, n1); return true;
      case QT_Q5_0: rows_impl<Blocks<Q5_0B, 2>>(xg, k, K, ldx, w, rb, y, ldy, n0, n1); return true;
      case QT_Q8_0: rows_impl<Blocks<Q8_0B, 2>>(xg, k, K, ldx, w, rb, y, ldy, n0, n1); return true;
      default: return false;
    }
  }
  switch (qtype) {
    case QT_Q4_K: rows_impl<SuperBlocks<Q4K>>(xg, k, K, ldx, w, rb, y, ldy, n0, n1); return true;
    case QT_Q4_K_R2: rows_impl<SuperBlocks<Q4K2, LANE_ROWS>>(xg, k, K, ldx, w, rb, y, ldy, n0, n1); return true;
    case QT_Q6_K_R16: rows_impl<SuperBlocks<Q6KR, LANE_ROWS>>(xg, k, K, ldx, w, rb, y, ldy, n0, n1); return true;
    case QT_Q6_K: rows_impl<SuperBlocks<Q6K>>(xg, k, K, ldx, w, rb, y, ldy, n0, n1); return true;
    case QT_Q4_0: rows_impl<Blocks<Q4_0B>>(xg, k, K, ldx, w, rb, y, ldy, n0, n1); return true;
    case QT_Q4_1: rows_impl<Blocks<Q4_1B>>(xg, k, K, ldx, w, rb, y, ldy, n0, n1); return true;
    case QT_Q5_0: rows_impl<Blocks<Q5_0B>>(xg, k, K, ldx, w, rb, y, ldy, n0, n1); return true;
    case QT_Q8_0: rows_impl<Blocks<Q8_0B>>(xg, k, K, ldx, w, rb, y, ldy, n0, n1); return true;
    default: return false;
  }
}

}  // namespace ultrafast

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86-64 GCC/clang: no AVX2 kernels

namespace ultrafast {
int64_t avx2_madd_chains(int64_t) { return 0; }
bool qmm_avx2_int8_supports(int) { return false; }
bool qmm_avx2_int16_supports(int) { return false; }
int64_t qmm_prep_bytes_avx2_int8(int, int64_t, bool) { return 0; }
int64_t qmm_prep_units_avx2_int8(int, int64_t) { return 0; }
void qmm_prep_avx2_int8(int, const float*, int64_t, uint8_t*, int64_t, int64_t, bool) {}
bool qmm_rows_avx2_int8(int, const uint8_t*, int64_t, int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t,
                        int64_t, bool) {
  return false;
}
}  // namespace ultrafast

#endif

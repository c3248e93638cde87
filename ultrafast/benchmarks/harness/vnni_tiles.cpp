// A 1-thread harness over the VNNI unit (qmatmul_vnni.cpp, included whole: the very code the engine runs) on a
// random Q4_K matrix repacked as the engine repacks it (QT_Q4_K_R2), int8 activations. Built and run by
// `python -m ultrafast.benchmarks.kernel_harness`; no part of the engine. Microseconds per call, best of `reps`:
//   tiles  N K k reps   the engine's schedule against forced tiles (1 x 16; 2 x 4, 2 x 5, 2 x 6: each x vector loaded
//                       once for two weight rows, chunks of activation rows; 2 x k: all rows in one sweep, the
//                       accumulators spilled), each output's bits compared with the engine's
//   amx    N K k reps   an AMX prototype (below) against the engine's kernel, bits compared
//   lanes  N K k reps   the same products by vpdpbusd over the AMX prototype's layout (int32 lanes = 16 weight rows,
//                       x as 4-byte broadcasts), bits compared, and the same loop without its weight decode, without
//                       its fp32 step, and without both (where the time of a k-row product goes)
//   mix    reps         G vpdpbusd/s of the kernels' instruction mix: on register operands (vnni_paired_chains), the
//                       one-row tile's pattern with its operands from L1 and no weight decode, bare vpdpbusd
#include "../../kernels/qmatmul_vnni.cpp"

#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace ultrafast;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

template <class F>
double best_us(int reps, F&& f) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now();
    f();
    const double dt = now() - t0;
    if (dt < best) best = dt;
  }
  return best * 1e6;
}

// Random Q4_K rows with sane fp16 scales (d, dmin in [2^-9, 2^-8)), repacked; activations in [-1, 1).
struct Problem {
  int64_t N, K, k, rb;
  std::vector<uint8_t> file;
  uint8_t* w = nullptr;   // the engine's layout (QT_Q4_K_R2)
  uint8_t* xg = nullptr;  // prepared x (int8)
  int64_t ldx = 0;
  std::vector<float> x;
  Problem(int64_t N_, int64_t K_, int64_t k_) : N(N_), K(K_), k(k_), rb(K_ / 256 * 144), file(N_ * rb), x(K_ * k_) {
    std::mt19937 g(1);
    for (auto& b : file) b = (uint8_t)g();
    for (int64_t i = 0; i < N * K / 256; ++i) file[i * 144 + 1] = file[i * 144 + 3] = 0x1c;
    w = (uint8_t*)aligned_alloc(64, N * rb);
    qmm_repack_vnni(QT_Q4_K, file.data(), w, N, K);
    ldx = qmm_prep_bytes_vnni(QT_Q4_K_R2, K, true);
    xg = (uint8_t*)aligned_alloc(64, ldx * k + 64);
    for (auto& v : x) v = (float)(g() % 2000) / 1000.0f - 1.0f;
    for (int64_t r = 0; r < k; ++r)
      qmm_prep_vnni(QT_Q4_K_R2, x.data() + r * K, K, xg + r * ldx, 0, qmm_prep_units_vnni(QT_Q4_K_R2, K), true);
  }
  void engine(float* y) const { qmm_rows_vnni(QT_Q4_K_R2, xg, k, K, w, rb, y, N, 0, N, true); }
};

int64_t mismatches(const std::vector<float>& a, const std::vector<float>& b) {
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], 4) != 0;
  return n;
}

// Two weight rows against all k activation rows in one sweep: each x vector loaded once for both rows (the one-row
// tile loads it per vpdpbusd), the 2k accumulators left to the compiler (they spill past 32 registers). The same
// per-output operations as the engine's KQ4K2 kernel: the integer products, t = d * s, fma, then the mins' fnmadd.
template <int R>
__attribute__((noinline)) void two_rows_all(const uint8_t* w, int64_t rb, int64_t K, const uint8_t* xg, int64_t ldx,
                                            float* y, int64_t N) {
  using X = XGN<8, true>;
  for (int64_t n = 0; n < N; n += 2) {
    __m512 acc[2][R];
    for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / 512; ++b) {
      const uint8_t* p[2] = {w + n * rb + b * 288, w + (n + 1) * rb + b * 288};
      const KQ4K2::Ctx c[2] = {KQ4K2::context(p[0], 16), KQ4K2::context(p[1], 16)};
      __m512i W[2][8];
      __m512 d[2], m[2];
      for (int i = 0; i < 2; ++i) KQ4K2::decode(p[i], 0, c[i], W[i], d[i], m[i]);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const X* xr = reinterpret_cast<const X*>(xg + r * ldx) + b;
        __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int v = 0; v < 8; ++v) {
          __m512i xv = _mm512_load_si512(&xr->xh[v]);
          __asm__("" : "+v"(xv));  // one load for both rows
          a0 = _mm512_dpbusd_epi32(a0, W[0][v], xv);
          a1 = _mm512_dpbusd_epi32(a1, W[1][v], xv);
        }
        __m512 s = xr->s;
        __asm__("" : "+v"(s));
        acc[0][r] = _mm512_fnmadd_ps(c[0].m, xr->xsf, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0), _mm512_mul_ps(d[0], s), acc[0][r]));
        acc[1][r] = _mm512_fnmadd_ps(c[1].m, xr->xsf, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), _mm512_mul_ps(d[1], s), acc[1][r]));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 2; ++i) y[r * N + n + i] = _mm512_reduce_add_ps(acc[i][r]);
  }
}

int tiles(int64_t N, int64_t K, int64_t k, int reps) {
  if (N < 2 || N % 2 || K % 512 || k < 1 || k > 16) {
    std::fprintf(stderr, "tiles: N even, K a multiple of 512, k in 1..16\n");
    return 2;
  }
  Problem P(N, K, k);
  std::vector<float> ref(N * k), y(N * k);
  P.engine(ref.data());
  auto row = [&](const char* name, auto f) {
    std::fill(y.begin(), y.end(), 0.0f);
    const double us = best_us(reps, f);
    std::printf("%-8s N=%ld K=%ld k=%ld %8.1f us  bits %s\n", name, (long)N, (long)K, (long)k, us,
                mismatches(ref, y) ? "DIFFER" : "same");
  };
  for (int round = 0; round < 2; ++round) {
    row("engine", [&] { P.engine(y.data()); });
    row("1x16", [&] { schedule<KQ4K2, 1, 16, true>(P.xg, P.ldx, k, K, P.w, P.rb, y.data(), N, 0, N, true, rows_per_chunk(k, 16)); });
    row("2x4", [&] { schedule<KQ4K2, 2, 4, true>(P.xg, P.ldx, k, K, P.w, P.rb, y.data(), N, 0, N, true, rows_per_chunk(k, 4)); });
    row("2x5", [&] { schedule<KQ4K2, 2, 5, true>(P.xg, P.ldx, k, K, P.w, P.rb, y.data(), N, 0, N, true, rows_per_chunk(k, 5)); });
    row("2x6", [&] { schedule<KQ4K2, 2, 6, true>(P.xg, P.ldx, k, K, P.w, P.rb, y.data(), N, 0, N, true, rows_per_chunk(k, 6)); });
    row("2xk", [&] {
      with_rows<1, 16>(k, [&](auto R) { two_rows_all<decltype(R)::value>(P.w, P.rb, K, P.xg, P.ldx, y.data(), N); });
    });
  }
  return 0;
}

// The one-row tile's pattern, its operands from L1 and no weight decode: per activation row and group 8 vpdpbusd with
// x from memory, the scale multiply with s from memory, convert, fma; 10 rows, 3 groups, the weight vectors in registers.
__attribute__((noinline)) float tile_pattern(const uint8_t* x, int64_t iters) {
  constexpr int R = 10, G = 3;
  constexpr int64_t LDX = 704 * G;
  __m512 acc[R];
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512i W[8];
  for (int v = 0; v < 8; ++v) W[v] = _mm512_set1_epi8((char)(3 + v));
  __m512 d = _mm512_set1_ps(1e-3f);
  for (int64_t it = 0; it < iters; ++it)
    for (int g = 0; g < G; ++g) {
      __asm__ volatile("" : "+v"(W[0]), "+v"(W[1]), "+v"(W[2]), "+v"(W[3]), "+v"(W[4]), "+v"(W[5]), "+v"(W[6]),
                       "+v"(W[7]), "+v"(d));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const uint8_t* xr = x + r * LDX + g * 704;
        __m512i c = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int v = 0; v < 8; ++v) c = _mm512_dpbusd_epi32(c, W[v], _mm512_load_si512(xr + 64 * v));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_mul_ps(d, _mm512_load_ps((const float*)(xr + 512))), acc[r]);
      }
    }
  float s = 0.0f;
  for (auto& a : acc) s += _mm512_reduce_add_ps(a);
  return s;
}

int mix(int reps) {
  const int64_t n = 2000000;
  std::vector<uint8_t, std::allocator<uint8_t>> buf(704 * 3 * 10 + 64);
  uint8_t* x = (uint8_t*)(((uintptr_t)buf.data() + 63) & ~(uintptr_t)63);
  for (int64_t i = 0; i < 704 * 3 * 10; ++i) x[i] = (uint8_t)(i * 7);
  for (int r = 0; r < 10; ++r)
    for (int g = 0; g < 3; ++g)
      for (int j = 0; j < 48; ++j) ((float*)(x + r * 704 * 3 + g * 704 + 512))[j] = 1e-3f;  // no denormals
  volatile float sink = 0;
  const double reg = best_us(reps, [&] { sink = sink + (float)vnni_paired_chains(n, true); });
  const double pat = best_us(reps, [&] { sink = sink + tile_pattern(x, n / 3); });
  const double bare = best_us(reps, [&] { sink = sink + (float)vnni_dpbusd_chains(n); });
  std::printf("arithmetic on register operands  %.2f G vpdpbusd/s\n", n * 12.0 * 8 / reg / 1e3);
  std::printf("one-row tile's pattern, L1 operands, no decode  %.2f G vpdpbusd/s\n", (n / 3) * 3.0 * 10 * 8 / pat / 1e3);
  std::printf("bare vpdpbusd  %.2f G/s\n", n * 12.0 / bare / 1e3);
  return 0;
}

}  // namespace


// ---- an AMX prototype (not the engine's: it measures what tile multiplies would give under these numerics) ----
// Per 16 weight rows and block of 32 (a unit): B = the 16 rows' 32 nibbles of the block split into bytes (8 rows of 64:
// row v, bytes 4n..4n+3 = values 4v..4v+3 of weight row n; from a copy of the weights laid out for it, `amx_layout`),
// A = the block's int8 x (R rows of the plain quantized row, stride K), TDPBSUD into C (R x 16 int32), C stored; then
// the fp32 step on vectors over the 16 weight rows, per activation row: t = (d * sc) * s, a = fma(cvt(C), t, a),
// a = fnmadd(dmin * m, s * xsum, a): per output the operations of the VNNI kernel's lane, so the bits are the same. Each
// lane's groups run in turn so that its R accumulators stay in registers; the final sum is _mm512_reduce_add_ps's tree
// on vectors over weight rows. Decode 6 units ahead, tiles 4 ahead, two sets of tiles.
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

namespace {

struct TileConfig {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// The nibbles of each 16-row tile, group and lane (a block: sub-block l % 8 of super-block 2G + l / 8), 256 bytes a unit:
// chunk u, byte 4n + j holds value 8u + j of row n's block (low nibble) and 8u + 4 + j (high nibble), as the engine's
// layout holds them for its lane l.
std::vector<uint8_t> amx_layout(const uint8_t* r2, int64_t rb, int64_t N, int64_t K) {
  const int64_t NG = K / 512;
  std::vector<uint8_t> out(N * K / 2);
  for (int64_t t = 0; t < N / 16; ++t)
    for (int64_t G = 0; G < NG; ++G)
      for (int l = 0; l < 16; ++l)
        for (int n = 0; n < 16; ++n)
          for (int u = 0; u < 4; ++u)
            for (int j = 0; j < 4; ++j)
              out[((t * NG + G) * 16 + l) * 256 + 64 * u + 4 * n + j] = r2[(16 * t + n) * rb + G * 288 + 32 + 64 * u + 4 * l + j];
  return out;
}

// d * sc and dmin * m of every tile, group and lane as vectors over the tile's 16 weight rows: [t][G][l][d 16, m 16].
void amx_scales(const uint8_t* r2, int64_t rb, int64_t t, int64_t G, float* out) {
  alignas(64) float d[16][16], m[16][16];
  for (int w = 0; w < 16; ++w) {
    const auto c = KQ4K2::context(r2 + (16 * t + w) * rb + G * 288, 16);
    _mm512_store_ps(d[w], c.d);
    _mm512_store_ps(m[w], c.m);
  }
  for (int l = 0; l < 16; ++l)
    for (int w = 0; w < 16; ++w) out[l * 32 + w] = d[w][l], out[l * 32 + 16 + w] = m[w][l];
}

// TILES false: the same without the tile instructions (C as left), to time the vector work alone.
template <int R, bool PRE, bool TILES>
__attribute__((noinline)) void amx_rows(const uint8_t* r2, int64_t rb, const uint8_t* wa, const float* pre, int64_t N,
                                        int64_t K, const int8_t* xq, const float* xs, const float* xsf, float* y) {
  const int64_t NG = K / 512, NB = K / 32, NU = 16 * NG;
  std::vector<float> own(PRE ? 0 : NG * 16 * 32);
  alignas(64) uint8_t bbuf[8][512];
  alignas(64) int32_t cbuf[8][16][16] = {};
  alignas(64) float accbuf[16][R][16];
  for (int64_t t = 0; t < N / 16; ++t) {
    const float* sc = PRE ? pre + t * NG * 16 * 32 : own.data();
    if (!PRE)
      for (int64_t G = 0; G < NG; ++G) amx_scales(r2, rb, t, G, own.data() + G * 16 * 32);
    const uint8_t* wt = wa + t * NG * 16 * 256;
    auto xoff = [&](int64_t u) { const int64_t l = u / NG, G = u % NG; return 512 * G + 256 * (l / 8) + 32 * (l % 8); };
    auto decode = [&](int64_t u) {
      __m512i W[8];
      split_nibble_chunks(wt + ((u % NG) * 16 + u / NG) * 256, W);
      for (int v = 0; v < 8; ++v) _mm512_store_si512(bbuf[u & 7] + 64 * v, W[v]);
    };
    auto tiles = [&](int64_t u) {
      if constexpr (TILES) {
        if (u & 1) {
          _tile_loadd(5, bbuf[u & 7], 64); _tile_loadd(4, xq + xoff(u), K); _tile_zero(3);
          _tile_dpbsud(3, 4, 5); _tile_stored(3, cbuf[u & 7], 64);
        } else {
          _tile_loadd(2, bbuf[u & 7], 64); _tile_loadd(1, xq + xoff(u), K); _tile_zero(0);
          _tile_dpbsud(0, 1, 2); _tile_stored(0, cbuf[u & 7], 64);
        }
      }
    };
    constexpr int D1 = 6, D2 = 4;
    for (int64_t u = 0; u < D1 && u < NU; ++u) decode(u);
    for (int64_t u = 0; u < D2 && u < NU; ++u) tiles(u);
    __m512 a[R];
    for (int64_t u = 0; u < NU; ++u) {
      if (u + D1 < NU) decode(u + D1);
      if (u + D2 < NU) tiles(u + D2);
      const int64_t l = u / NG, G = u % NG, xb = xoff(u) / 32;
      if (G == 0)
        for (auto& v : a) v = _mm512_setzero_ps();
      const __m512 dv = _mm512_loadu_ps(sc + (G * 16 + l) * 32), mv = _mm512_loadu_ps(sc + (G * 16 + l) * 32 + 16);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 tt = _mm512_mul_ps(dv, _mm512_set1_ps(xs[r * NB + xb]));
        a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cbuf[u & 7][r])), tt, a[r]);
        a[r] = _mm512_fnmadd_ps(mv, _mm512_set1_ps(xsf[r * NB + xb]), a[r]);
      }
      if (G == NG - 1)
        for (int r = 0; r < R; ++r) _mm512_store_ps(accbuf[l][r], a[r]);
    }
    for (int r = 0; r < R; ++r) {  // _mm512_reduce_add_ps's tree, lane by lane, on vectors over weight rows
      __m512 U[8], V[4];
      for (int i = 0; i < 8; ++i) U[i] = _mm512_add_ps(_mm512_load_ps(accbuf[8 + i][r]), _mm512_load_ps(accbuf[i][r]));
      for (int i = 0; i < 4; ++i) V[i] = _mm512_add_ps(U[4 + i], U[i]);
      _mm512_storeu_ps(y + r * N + 16 * t, _mm512_add_ps(_mm512_add_ps(V[0], V[2]), _mm512_add_ps(V[1], V[3])));
    }
  }
}

}  // namespace

// Whether `amx` and `lanes` take the shape (whole tiles of 16 weight rows, groups of 512, 1..16 activation rows); else
// one line on stderr.
bool tile_shape(int64_t N, int64_t K, int64_t k, const char* cmd) {
  if (N % 16 == 0 && K % 512 == 0 && k >= 1 && k <= 16) return true;
  std::fprintf(stderr, "%s: N a multiple of 16, K of 512, k in 1..16\n", cmd);
  return false;
}

// The plain int8 x of each activation row as the engine's prep quantizes it (quant32), with each block's s_b and
// s_b * xsum_b: what the AMX prototype's A tiles and the lanes kernel read.
struct PlainX {
  std::vector<int8_t> q;
  std::vector<float> s, sf;
  explicit PlainX(const Problem& P) : q(P.K * 16), s(16 * P.K / 32), sf(16 * P.K / 32) {
    const int64_t NB = P.K / 32;
    for (int64_t r = 0; r < P.k; ++r)
      for (int64_t b = 0; b < NB; ++b) {
        int16_t v[32];
        int32_t sum;
        const float sb = quant32<true>(P.x.data() + r * P.K + 32 * b, v, &sum);
        for (int i = 0; i < 32; ++i) q[r * P.K + 32 * b + i] = (int8_t)v[i];
        s[r * NB + b] = sb;
        sf[r * NB + b] = sb * (float)sum;
      }
  }
};

// The weights laid out for the tiles (amx_layout) and their scales precomputed (amx_scales), for `amx` and `lanes`.
struct TileWeights {
  std::vector<uint8_t> wa;
  std::vector<float> pre;
  explicit TileWeights(const Problem& P) : wa(amx_layout(P.w, P.rb, P.N, P.K)), pre(P.N / 16 * (P.K / 512) * 16 * 32) {
    const int64_t NG = P.K / 512;
    for (int64_t t = 0; t < P.N / 16; ++t)
      for (int64_t G = 0; G < NG; ++G) amx_scales(P.w, P.rb, t, G, pre.data() + (t * NG + G) * 16 * 32);
  }
};

// The Q4_K products by vpdpbusd over amx_layout's units (16 weight rows x one block of 32): the unit's 8 weight vectors
// hold in int32 lane n four values of weight row n, so each x dword (4 values of one activation row) goes to the
// multiplier as a broadcast and one decode feeds all R activation rows; per activation row and unit 8 vpdpbusd, then
// the fp32 step of the engine's lane (t = (d * sc) * s, fma, fnmadd) on vectors over the 16 weight rows, each block
// position's groups in turn (its R accumulators in registers), the final sum _mm512_reduce_add_ps's tree on vectors
// over weight rows: every output the engine's operations, so the same bits. ABLATE (to time the parts; bits not kept):
// bit 0 leaves the weight decode out (constant weight vectors), bit 1 the fp32 step (the integer sums xor-ed into the
// accumulators).
template <int R, int ABLATE>
__attribute__((noinline)) void lanes_rows(const uint8_t* wa, const float* pre, int64_t N, int64_t K, const int8_t* xq,
                                          const float* xs, const float* xsf, float* y) {
  const int64_t NG = K / 512, NB = K / 32;
  alignas(64) float accbuf[16][R][16];
  for (int64_t t = 0; t < N / 16; ++t) {
    const float* sc = pre + t * NG * 16 * 32;
    const uint8_t* wt = wa + t * NG * 16 * 256;
    for (int l = 0; l < 16; ++l) {
      __m512 a[R];
      for (auto& v : a) v = _mm512_setzero_ps();
      for (int64_t G = 0; G < NG; ++G) {
        __m512i W[8];
        if constexpr (ABLATE & 1) {
          for (int v = 0; v < 8; ++v) {
            W[v] = _mm512_set1_epi8((char)(v + G));
            __asm__("" : "+v"(W[v]));
          }
        } else {
          split_nibble_chunks(wt + (G * 16 + l) * 256, W);
        }
        const int64_t xo = 512 * G + 32 * l, xb = xo / 32;
        const __m512 dv = _mm512_loadu_ps(sc + (G * 16 + l) * 32), mv = _mm512_loadu_ps(sc + (G * 16 + l) * 32 + 16);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq + r * K + xo;
          __m512i c = _mm512_setzero_si512();
#pragma GCC unroll 8
          for (int v = 0; v < 8; ++v) {
            int32_t xv;
            __builtin_memcpy(&xv, xr + 4 * v, 4);
            c = _mm512_dpbusd_epi32(c, W[v], _mm512_set1_epi32(xv));
          }
          if constexpr (ABLATE & 2) {
            a[r] = _mm512_castsi512_ps(_mm512_xor_si512(c, _mm512_castps_si512(a[r])));
          } else {
            const __m512 tt = _mm512_mul_ps(dv, _mm512_set1_ps(xs[r * NB + xb]));
            a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), tt, a[r]);
            a[r] = _mm512_fnmadd_ps(mv, _mm512_set1_ps(xsf[r * NB + xb]), a[r]);
          }
        }
      }
      for (int r = 0; r < R; ++r) _mm512_store_ps(accbuf[l][r], a[r]);
    }
    for (int r = 0; r < R; ++r) {
      __m512 U[8], V[4];
      for (int i = 0; i < 8; ++i) U[i] = _mm512_add_ps(_mm512_load_ps(accbuf[8 + i][r]), _mm512_load_ps(accbuf[i][r]));
      for (int i = 0; i < 4; ++i) V[i] = _mm512_add_ps(U[4 + i], U[i]);
      _mm512_storeu_ps(y + r * N + 16 * t, _mm512_add_ps(_mm512_add_ps(V[0], V[2]), _mm512_add_ps(V[1], V[3])));
    }
  }
}

int lanes(int64_t N, int64_t K, int64_t k, int reps) {
  if (!tile_shape(N, K, k, "lanes")) return 2;
  Problem P(N, K, k);
  const TileWeights TW(P);
  const PlainX X(P);
  std::vector<float> ref(N * k), y(N * k);
  P.engine(ref.data());
  auto run = [&](auto ablate) {
    with_rows<1, 16>(k, [&](auto Rc) {
      lanes_rows<decltype(Rc)::value, decltype(ablate)::value>(TW.wa.data(), TW.pre.data(), N, K, X.q.data(),
                                                                X.s.data(), X.sf.data(), y.data());
    });
  };
  for (int round = 0; round < 2; ++round) {
    std::printf("engine                   N=%ld K=%ld k=%ld %8.1f us\n", (long)N, (long)K, (long)k,
                best_us(reps, [&] { P.engine(y.data()); }));
    std::printf("lanes                    N=%ld K=%ld k=%ld %8.1f us", (long)N, (long)K, (long)k,
                best_us(reps, [&] { run(Rows<0>{}); }));
    std::printf("  bits %s\n", mismatches(ref, y) ? "DIFFER" : "same");
    std::printf("  without decode         N=%ld K=%ld k=%ld %8.1f us\n", (long)N, (long)K, (long)k,
                best_us(reps, [&] { run(Rows<1>{}); }));
    std::printf("  without fp32 step      N=%ld K=%ld k=%ld %8.1f us\n", (long)N, (long)K, (long)k,
                best_us(reps, [&] { run(Rows<2>{}); }));
    std::printf("  without both           N=%ld K=%ld k=%ld %8.1f us\n", (long)N, (long)K, (long)k,
                best_us(reps, [&] { run(Rows<3>{}); }));
  }
  return 0;
}

int amx(int64_t N, int64_t K, int64_t k, int reps) {
  if (!tile_shape(N, K, k, "amx")) return 2;
  if (!__builtin_cpu_supports("amx-int8") || syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* tile data */)) {
    std::printf("amx: this CPU or kernel offers no AMX tiles\n");
    return 0;
  }
  Problem P(N, K, k);
  const TileWeights TW(P);
  const std::vector<uint8_t>& wa = TW.wa;
  const std::vector<float>& pre = TW.pre;
  const PlainX X(P);
  const int8_t* xq = X.q.data();
  const float *xs = X.s.data(), *xsf = X.sf.data();
  TileConfig cfg{};
  cfg.palette = 1;
  for (int s = 0; s < 2; ++s) {
    cfg.rows[3 * s] = (uint8_t)k, cfg.colsb[3 * s] = 64;          // C
    cfg.rows[3 * s + 1] = (uint8_t)k, cfg.colsb[3 * s + 1] = 32;  // A: x
    cfg.rows[3 * s + 2] = 8, cfg.colsb[3 * s + 2] = 64;           // B: weights
  }
  _tile_loadconfig(&cfg);
  std::vector<float> ref(N * k), y(N * k);
  P.engine(ref.data());
  auto run = [&](bool pre_scales, bool tiles) {
    with_rows<1, 16>(k, [&](auto Rc) {
      constexpr int R = decltype(Rc)::value;
      if (pre_scales && tiles) amx_rows<R, true, true>(P.w, P.rb, wa.data(), pre.data(), N, K, xq, xs, xsf, y.data());
      else if (pre_scales) amx_rows<R, true, false>(P.w, P.rb, wa.data(), pre.data(), N, K, xq, xs, xsf, y.data());
      else amx_rows<R, false, true>(P.w, P.rb, wa.data(), pre.data(), N, K, xq, xs, xsf, y.data());
    });
  };
  for (int round = 0; round < 2; ++round) {
    std::printf("engine          N=%ld K=%ld k=%ld %8.1f us\n", (long)N, (long)K, (long)k, best_us(reps, [&] { P.engine(y.data()); }));
    std::printf("amx             N=%ld K=%ld k=%ld %8.1f us", (long)N, (long)K, (long)k, best_us(reps, [&] { run(false, true); }));
    std::printf("  bits %s\n", mismatches(ref, y) ? "DIFFER" : "same");
    std::printf("amx, pre scales N=%ld K=%ld k=%ld %8.1f us", (long)N, (long)K, (long)k, best_us(reps, [&] { run(true, true); }));
    std::printf("  bits %s\n", mismatches(ref, y) ? "DIFFER" : "same");
    std::printf("  without tiles N=%ld K=%ld k=%ld %8.1f us\n", (long)N, (long)K, (long)k, best_us(reps, [&] { run(true, false); }));
  }
  // The tile instructions alone, from fixed L1 buffers: one unit's (two sets in turn, as above), and its store alone.
  const int64_t units = 200000;
  alignas(64) static uint8_t b[2][512];
  alignas(64) static int32_t c[2][16][16];
  const double all = best_us(reps, [&] {
    for (int64_t i = 0; i < units; i += 2) {
      _tile_loadd(2, b[0], 64); _tile_loadd(1, xq, K); _tile_zero(0); _tile_dpbsud(0, 1, 2); _tile_stored(0, c[0], 64);
      _tile_loadd(5, b[1], 64); _tile_loadd(4, xq + 32, K); _tile_zero(3); _tile_dpbsud(3, 4, 5); _tile_stored(3, c[1], 64);
    }
  });
  const double stores = best_us(reps, [&] {
    for (int64_t i = 0; i < units; i += 2) { _tile_stored(0, c[0], 64); _tile_stored(3, c[1], 64); }
  });
  std::printf("a unit's tile instructions alone %.2f ns, its TILESTORED alone %.2f ns (k=%ld rows)\n", all * 1e3 / units,
              stores * 1e3 / units, (long)k);
  _tile_release();
  return 0;
}
#pragma GCC pop_options

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  if (cmd == "tiles" && argc == 6) return tiles(atoll(argv[2]), atoll(argv[3]), atoll(argv[4]), atoi(argv[5]));
  if (cmd == "amx" && argc == 6) return amx(atoll(argv[2]), atoll(argv[3]), atoll(argv[4]), atoi(argv[5]));
  if (cmd == "lanes" && argc == 6) return lanes(atoll(argv[2]), atoll(argv[3]), atoll(argv[4]), atoi(argv[5]));
  if (cmd == "mix" && argc == 3) return mix(atoi(argv[2]));
  std::fprintf(stderr, "usage: %s tiles|amx|lanes N K k reps | mix reps\n", argv[0]);
  return 2;
}

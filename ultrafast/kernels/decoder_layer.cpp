// The decoder layer (pre-norm attention + SwiGLU feed-forward) of the packed path: the one fused
// implementation, whatever the kernel variant (kernel_variant.h: the linears' and attention's ops come in
// LayerArgs). The PyTorch reference is ultrafast/model.py.
//
// The whole layer runs in ONE OpenMP parallel region: the team of threads is woken once per layer and steps
// through its stages separated by barriers, instead of forking and joining ~10 times (one per matmul, norm,
// attention). On 2 cores a fork/join costs several microseconds, about as much as a small model's matmul
// itself; a barrier costs a fraction of that.
//
// Stages (each split across the team; a barrier between dependent stages):
//   rmsnorm -> prep(h) -> q,k,v -> bias, RoPE, cache write -> attention -> prep(att) -> wo -> residual,
//   rmsnorm -> prep(h2) -> gate, up -> SiLU*up -> prep(g) -> down -> residual.
// Under tensor parallelism (LayerArgs::part) the layer runs as its two halves, each ending at wo's or down's
// output (a rank's partial sum): the caller all-reduces it and adds the residual between them.
// Sequences that hold the same first rows in their caches (best-of-n candidates of one prompt) may be told so
// (LayerArgs::share_src): attention then reads those rows from one of the caches for all of them (the same values),
// from L2 after the first sequence's read, since a thread's tasks take a kv head's rows one after the other.
// Batch invariance is kept: every output element is computed by one thread with arithmetic that depends
// only on its own row (the variant's prep and rows, its attention, and the per-row norm/RoPE loops below);
// how rows, units or tasks are split between threads never changes an operation. Matmul stages split the
// weight rows of all their matrices (q, k and v together; gate and up together) by bytes, in chunks of 16
// rows.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "decoder_layer.h"
#include "qmatmul_kernels.h"
#include "row_ops.h"
#include "scratch.h"

namespace ultrafast {
namespace {

inline void split(int64_t n, int nt, int t, int64_t* a, int64_t* b) {
  *a = n * t / nt;
  *b = n * (t + 1) / nt;
}

constexpr int64_t CH = 16;  // weight rows per matmul work chunk

struct Mat {
  const LinearOps* ops;
  const uint8_t* w;
  int64_t rb, N, K;
  int qt;
  const uint8_t* xg;  // prepared input rows
  float* y;           // [T, N]
};

// This thread's share of the matmuls in `m` (split by weight bytes, whole chunks of CH rows).
bool matmuls(const Mat* m, int nm, int64_t T, int nt, int t, bool x8) {
  int64_t total = 0;
  for (int i = 0; i < nm; ++i) total += m[i].N * m[i].rb;
  const int64_t lo = total * t / nt, hi = total * (t + 1) / nt;
  int64_t off = 0;
  bool ok = true;
  for (int i = 0; i < nm; ++i) {
    const int64_t cb = CH * m[i].rb, nch = (m[i].N + CH - 1) / CH;
    // chunks whose first byte lies in [lo, hi)
    auto first_at = [&](int64_t b) -> int64_t {
      if (b <= off) return 0;
      const int64_t c = (b - off + cb - 1) / cb;
      return c < nch ? c : nch;
    };
    const int64_t c0 = first_at(lo), c1 = first_at(hi);
    if (c1 > c0) {
      const int64_t n0 = c0 * CH, n1 = c1 * CH < m[i].N ? c1 * CH : m[i].N;
      ok &= m[i].ops->rows(m[i].qt, m[i].xg, T, m[i].K, m[i].w, m[i].rb, m[i].y, m[i].N, n0, n1, x8);
    }
    off += m[i].N * m[i].rb;
  }
  return ok;
}

// This thread's share of preparing T rows of x (K wide) for a linear: tasks are (row, run of prep units).
void prep(const LinearOps* ops, int qt, const float* x, int64_t T, int64_t K, uint8_t* xg, int nt, int t, bool x8) {
  const int64_t nu = ops->prep_units(qt, K), ldx = ops->prep_bytes(qt, K, x8);
  const int64_t per = 8;  // units per task
  const int64_t tpr = (nu + per - 1) / per, ntask = T * tpr;
  int64_t a, b;
  split(ntask, nt, t, &a, &b);
  for (int64_t i = a; i < b; ++i) {
    const int64_t r = i / tpr, u0 = (i % tpr) * per, u1 = u0 + per < nu ? u0 + per : nu;
    ops->prep(qt, x + r * K, K, xg + r * ldx, u0, u1, x8);
  }
}

}  // namespace

bool decoder_layer(const LayerArgs& a) {
  const int64_t T = a.T, d = a.d, hd = a.hd, nq = a.n_heads * hd, nkv = a.n_kv_heads * hd, f = a.f;
  const int nt = a.nthreads < 1 ? 1 : a.nthreads;
  // prepared inputs: by linear (wq, wk, wv share h; w1, w3 share h2); one buffer per distinct type
  int src[7];
  int64_t xgb[7];  // bytes of linear i's prepared input
  for (int i = 0; i < 7; ++i) {
    src[i] = i;
    const int first = i < 3 ? 0 : (i == 4 || i == 5) ? 4 : i;
    for (int j = first; j < i; ++j)
      if (a.qt[j] == a.qt[i] && a.ops[j] == a.ops[i]) {
        src[i] = src[j];
        break;
      }
    const int64_t K = i == 3 ? nq : (i == 6 ? f : d);
    xgb[i] = src[i] == i ? T * a.ops[i]->prep_bytes(a.qt[i], K, a.x8) : 0;
  }
  // attention tasks: (kv head, run of gh heads of its group, segment row), the rows fastest, so that a thread's
  // tasks read one kv head's keys and values row after row (from L2 after the first row) instead of two kv heads'
  // in turn. A run of heads reads its kv head's cache once for all of them, so heads are split into runs (which
  // read the cache once each) only while the tasks would leave threads idle or unevenly loaded.
  const int64_t group = a.n_heads / a.n_kv_heads;
  int64_t gh = group < 6 ? group : 6;
  auto ntasks = [&](int64_t g) { return T * a.n_kv_heads * ((group + g - 1) / g); };
  while (gh > 1 && ntasks(gh) % nt != 0 && ntasks(gh) < 4 * nt) gh = (gh + 1) / 2;
  const int64_t nsub = (group + gh - 1) / gh;
  int64_t maxlen = 0;
  std::vector<int64_t> seg_of((size_t)T), pos_of((size_t)T);
  for (int64_t s = 0, row = 0; s < a.nseg; ++s)
    for (int64_t i = 0; i < a.lens[s]; ++i, ++row) {
      seg_of[row] = s;
      pos_of[row] = a.starts[s] + i;
      maxlen = maxlen > pos_of[row] + 1 ? maxlen : pos_of[row] + 1;
      if (a.tree_keys) {
        const int64_t L = a.tree_keys[2 * row] + a.tree_keys[2 * row + 1];
        maxlen = maxlen > L ? maxlen : L;
      }
    }
  const int64_t lds = (maxlen + 16 + 15) / 16 * 16;
  // scratch: activations, prepared inputs, attention scores: the calling thread's scratch, carved in 64-byte aligned
  // pieces (the prepared rows are read and written with aligned vector moves); every piece is written before
  // it is read
  const int64_t fl = (int64_t)sizeof(float);
  const int64_t sizes[16] = {T * d * fl, T * nq * fl, T * nkv * fl, T * nkv * fl, T * nq * fl, T * d * fl,
                             T * f * fl, T * f * fl, nt * gh * lds * fl, xgb[0], xgb[1], xgb[2], xgb[3], xgb[4],
                             xgb[5], xgb[6]};
  int64_t offs[16], total = 0;
  for (int i = 0; i < 16; ++i) {
    offs[i] = total;
    total += (sizes[i] + 63) / 64 * 64;
  }
  static thread_local Scratch scratch;
  uint8_t* base = scratch.get((size_t)total);
  if (!base) return false;
  auto fbuf = [&](int i) { return reinterpret_cast<float*>(base + offs[i]); };
  float *h = fbuf(0), *q = fbuf(1), *k = fbuf(2), *v = fbuf(3), *att = fbuf(4), *o = fbuf(5), *g = fbuf(6),
        *u = fbuf(7), *scores = fbuf(8);
  auto xgp = [&](int i) { return base + offs[9 + src[i]]; };
  bool ok = true;
  float* x = a.x;

#pragma omp parallel num_threads(nt) reduction(&& : ok)
  {
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    int64_t r0, r1;
    // (a.part is the same for the whole team, so every thread meets the same barriers)
    if (a.part != 2) {
    // 1. h = rmsnorm(x); prepare h for wq/wk/wv
    split(T, n, t, &r0, &r1);
    for (int64_t r = r0; r < r1; ++r) rmsnorm_row(x + r * d, a.attn_norm, d, a.eps, h + r * d);
#pragma omp barrier
    for (int i = 0; i < 3; ++i)
      if (src[i] == i) prep(a.ops[i], a.qt[i], h, T, d, xgp(i), n, t, a.x8);
#pragma omp barrier
    {
      const Mat m[3] = {{a.ops[0], a.w[0], a.rb[0], nq, d, a.qt[0], xgp(0), q},
                        {a.ops[1], a.w[1], a.rb[1], nkv, d, a.qt[1], xgp(1), k},
                        {a.ops[2], a.w[2], a.rb[2], nkv, d, a.qt[2], xgp(2), v}};
      ok = matmuls(m, 3, T, n, t, a.x8) && ok;
    }
#pragma omp barrier
    // 2. bias, RoPE (rotate-half), write the row's key and value into its sequence's cache
    split(T, n, t, &r0, &r1);
    {
      std::vector<float> tmp((size_t)hd);
      const int64_t half = hd / 2;
      for (int64_t r = r0; r < r1; ++r) {
        float* qr = q + r * nq;
        float* kr = k + r * nkv;
        float* vr = v + r * nkv;
        if (a.bq) {
          for (int64_t i = 0; i < nq; ++i) qr[i] += a.bq[i];
          for (int64_t i = 0; i < nkv; ++i) kr[i] += a.bk[i];
          for (int64_t i = 0; i < nkv; ++i) vr[i] += a.bv[i];
        }
        const float* c = a.cos + r * hd;
        const float* s = a.sin + r * hd;
        auto rope = [&](float* row) {
          for (int64_t i = 0; i < hd; ++i) {
            const float rot = i < half ? -row[i + half] : row[i - half];
            tmp[i] = row[i] * c[i] + rot * s[i];
          }
          std::memcpy(row, tmp.data(), sizeof(float) * hd);
        };
        for (int64_t hh = 0; hh < a.n_heads; ++hh) rope(qr + hh * hd);
        for (int64_t hh = 0; hh < a.n_kv_heads; ++hh) rope(kr + hh * hd);
        const int64_t s_ = seg_of[r], p = pos_of[r];
        for (int64_t hh = 0; hh < a.n_kv_heads; ++hh) {
          std::memcpy(a.kc[s_] + hh * a.ks0[s_] + p * hd, kr + hh * hd, sizeof(float) * hd);
          std::memcpy(a.vc[s_] + hh * a.vs0[s_] + p * hd, vr + hh * hd, sizeof(float) * hd);
        }
      }
    }
#pragma omp barrier
    // 3. attention: each row attends to its own sequence's cache up to its position
    {
      int64_t t0, t1;
      split(ntasks(gh), n, t, &t0, &t1);
      float* sc = scores + (size_t)t * gh * lds;
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t i = task % T, kvh = task / (T * nsub), sub = task / T % nsub;
        const int64_t h0 = kvh * group + sub * gh;
        const int64_t hn = gh < (kvh + 1) * group - h0 ? gh : (kvh + 1) * group - h0;
        const int64_t s_ = seg_of[i];
        const int64_t P = a.tree_keys ? a.tree_keys[2 * i] : pos_of[i] + 1;
        const int64_t L = a.tree_keys ? P + a.tree_keys[2 * i + 1] : P;
        const int64_t s0 = a.share_src ? a.share_src[s_] : -1;
        a.attn(q + (i * a.n_heads + h0) * hd, (int)hn, a.kc[s_] + kvh * a.ks0[s_],
                          a.vc[s_] + kvh * a.vs0[s_], L, hd, a.scale, sc, lds,
                          att + (i * a.n_heads + h0) * hd, P, a.tree_keys ? a.tree_extra + a.tree_off[i] : nullptr,
                          s0 >= 0 ? a.kc[s0] + kvh * a.ks0[s0] : nullptr,
                          s0 >= 0 ? a.vc[s0] + kvh * a.vs0[s0] : nullptr, s0 >= 0 ? a.share_rows[s_] : 0);
      }
    }
#pragma omp barrier
    prep(a.ops[3], a.qt[3], att, T, nq, xgp(3), n, t, a.x8);
#pragma omp barrier
    {
      const Mat m[1] = {{a.ops[3], a.w[3], a.rb[3], d, nq, a.qt[3], xgp(3), a.part == 1 ? a.out : o}};
      ok = matmuls(m, 1, T, n, t, a.x8) && ok;
    }
#pragma omp barrier
    }
    if (a.part != 1) {
    // 4. x += o (the whole layer); h = rmsnorm(x); prepare h for gate/up
    split(T, n, t, &r0, &r1);
    for (int64_t r = r0; r < r1; ++r) {
      if (a.part == 0)
        for (int64_t i = 0; i < d; ++i) x[r * d + i] += o[r * d + i];
      rmsnorm_row(x + r * d, a.ffn_norm, d, a.eps, h + r * d);
    }
#pragma omp barrier
    for (int i = 4; i < 6; ++i)
      if (src[i] == i) prep(a.ops[i], a.qt[i], h, T, d, xgp(i), n, t, a.x8);
#pragma omp barrier
    {
      const Mat m[2] = {{a.ops[4], a.w[4], a.rb[4], f, d, a.qt[4], xgp(4), g},
                        {a.ops[5], a.w[5], a.rb[5], f, d, a.qt[5], xgp(5), u}};
      ok = matmuls(m, 2, T, n, t, a.x8) && ok;
    }
#pragma omp barrier
    // 5. g = silu(g) * u (elementwise), prepare g for down, x += down(g)
    {
      int64_t e0, e1;
      split(T * f, n, t, &e0, &e1);
      if (e0 < e1) a.silu_mul(g + e0, u + e0, e1 - e0);
    }
#pragma omp barrier
    prep(a.ops[6], a.qt[6], g, T, f, xgp(6), n, t, a.x8);
#pragma omp barrier
    {
      const Mat m[1] = {{a.ops[6], a.w[6], a.rb[6], d, f, a.qt[6], xgp(6), a.part == 2 ? a.out : o}};
      ok = matmuls(m, 1, T, n, t, a.x8) && ok;
    }
#pragma omp barrier
    if (a.part == 0) {
      int64_t e0, e1;
      split(T * d, n, t, &e0, &e1);
      for (int64_t i = e0; i < e1; ++i) x[i] += o[i];
    }
    }
  }
  return ok;
}

}  // namespace ultrafast

// One sampled token from one row of logits: sampler.py's rule (temperature, top-k, top-p, min-p, then the inverse
// CDF at the request's uniform u, in vocabulary order) in a few passes over the row instead of a dozen PyTorch ops.
// On a 152k vocabulary the PyTorch ops took ~1.1 ms a token (topk 0.25 ms, the cumulative sums 0.15 ms each),
// ~12 ms of every ten-candidate step of the 1.5B (the forward: ~95 ms); this takes a small fraction of that.
//
// The rule, with w_i = exp(s_i - max s), s_i = x_i / T (x_i - max x when the top s overflows), the same as
// sampler.probabilities() up to the rounding of the sums (here in double):
//   top-k   drop s_i below the k-th largest s;
//   top-p   keep the w_i >= c, c the smallest w of the shortest run of largest w's whose sum reaches top_p * sum w
//           (ties at the edge are all kept, the top token always is);
//   min-p   keep the w_i >= min_p (max w = 1);
//   then the first kept i, in vocabulary order, whose running sum of kept w exceeds u * their total.
// A NaN logit counts as -inf. The scalar code below vectorizes (16 independent lanes per loop); w_i = 0 below
// e^-87 of the top token's (fp32's normal range), a total far under the sums' rounding.
// The row loops compare floats (NaN, the kept set): without trapping math those compares may be evaluated for every
// lane, which is what lets them vectorize. The results are the same.
#pragma GCC optimize("no-trapping-math")

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "scratch.h"

namespace ultrafast {
namespace {

// exp(t) for t <= 0 (Cephes' expf: t = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, times 2^n); exactly 1
// at 0; 0 below -87.3 (and for -inf, NaN).
__attribute__((always_inline)) inline float exp_nonpos(float t) {
  const bool live = t >= -87.3f;  // false for NaN too
  t = live ? t : 0.0f;
  const float big = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float n = (t * 1.44269504088896341f + big) - big;
  const float r = (t - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * r) * r + r + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return live ? p * scale : 0.0f;
}

constexpr int64_t L = 16;  // independent lanes of the row loops

__attribute__((always_inline)) inline float row_max(const float* s, int64_t n) {
  float m[L];
  for (int j = 0; j < L; ++j) m[j] = -INFINITY;
  int64_t i = 0;
  for (; i + L <= n; i += L)
    for (int j = 0; j < L; ++j) m[j] = s[i + j] > m[j] ? s[i + j] : m[j];
  float r = -INFINITY;
  for (; i < n; ++i) r = s[i] > r ? s[i] : r;
  for (int j = 0; j < L; ++j) r = m[j] > r ? m[j] : r;
  return r;
}

// The smallest value c of the shortest run of the largest v[0..n) whose sum reaches need (the smallest of all when none
// does): a selection in three-way partitions (larger than a pivot, equal, smaller), O(n) where a sort of a flat row's
// nucleus (tens of thousands of values) took milliseconds. Reorders v.
__attribute__((always_inline)) inline float nucleus_edge(float* v, int64_t n, double need) {
  if (n == 0) return 0.0f;
  float smallest = v[0];
  for (int64_t k = 1; k < n; ++k) smallest = v[k] < smallest ? v[k] : smallest;
  int64_t lo = 0, hi = n;
  double above = 0;  // the sum of the values larger than every one in [lo, hi)
  while (hi - lo > 32) {
    float a = v[lo], b = v[lo + (hi - lo) / 2], c = v[hi - 1];  // the pivot: the median of three
    const float piv = std::max(std::min(a, b), std::min(std::max(a, b), c));
    float* gt_end = std::partition(v + lo, v + hi, [piv](float x) { return x > piv; });
    float* eq_end = std::partition(gt_end, v + hi, [piv](float x) { return x == piv; });
    double sgt = 0;
    for (float* q = v + lo; q < gt_end; ++q) sgt += *q;
    if (above + sgt >= need) {  // within the larger ones
      hi = gt_end - v;
      continue;
    }
    above += sgt;
    const double seq = (double)piv * (double)(eq_end - gt_end);
    if (above + seq >= need) return piv;
    above += seq;
    lo = eq_end - v;
  }
  std::sort(v + lo, v + hi, std::greater<float>());
  for (int64_t k = lo; k < hi; ++k) {
    above += v[k];
    if (above >= need) return v[k];
  }
  return smallest;
}

// The rule on x[0..V) with w (V floats of scratch); -1 when no token has a finite logit. Compiled for AVX-512, AVX2
// and the baseline, chosen at load by the CPU (the loops are the same; wider registers run them ~2x faster).
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) int64_t sample_core(
    const float* x, int64_t V, float* w, double temperature, int64_t top_k, double top_p, double min_p, double u) {
  // s = x / T in w; NaN -> -inf
  const float T = (float)temperature;
  for (int64_t i = 0; i < V; ++i) {
    const float v = x[i] / T;
    w[i] = v == v ? v : -INFINITY;
  }
  float M = row_max(w, V);
  if (!std::isfinite(M)) {  // a temperature so small that the top logits overflow: their limit
    float mx = -INFINITY;
    for (int64_t i = 0; i < V; ++i) mx = x[i] > mx ? x[i] : mx;
    if (!std::isfinite(mx)) return -1;
    for (int64_t i = 0; i < V; ++i) {
      const float v = (x[i] - mx) / T;
      w[i] = v == v ? v : -INFINITY;
    }
    M = row_max(w, V);
  }
  if (top_k > 0 && top_k < V) {  // the k-th largest s among the s within d of the top, d widened until k are
    std::vector<float> top;
    for (float d = 4.0f;; d *= 16.0f) {  // 4, 64, 1024, then all
      top.clear();
      const float lo = d < 2000.0f ? M - d : -INFINITY;
      for (int64_t k = 0; k < V; ++k)
        if (w[k] >= lo) top.push_back(w[k]);
      if ((int64_t)top.size() >= top_k || !(d < 2000.0f)) break;
    }
    float kth = -INFINITY;
    if ((int64_t)top.size() >= top_k) {
      std::nth_element(top.begin(), top.begin() + (top_k - 1), top.end(), std::greater<float>());
      kth = top[top_k - 1];
    }
    for (int64_t i = 0; i < V; ++i) w[i] = w[i] < kth ? -INFINITY : w[i];
  }
  // w = exp(s - M), their sum
  double zl[L] = {0};
  int64_t i = 0;
  for (; i + L <= V; i += L)
    for (int j = 0; j < L; ++j) {
      w[i + j] = exp_nonpos(w[i + j] - M);
      zl[j] += w[i + j];
    }
  double Z = 0;
  for (; i < V; ++i) w[i] = exp_nonpos(w[i] - M), Z += w[i];
  for (int j = 0; j < L; ++j) Z += zl[j];

  float cut = 0.0f;  // keep w_i >= cut (and > 0)
  if (top_p < 1.0) {
    const double need = top_p * Z;
    std::vector<float> top;
    for (float t = 0x1p-8f;; t *= 0x1p-6f) {  // the w's above t, lowered until they reach the mass
      top.clear();
      double sum = 0;
      for (int64_t k = 0; k < V; ++k)
        if (w[k] >= t) top.push_back(w[k]), sum += w[k];
      if (sum >= need || t < 0x1p-120f) break;
    }
    cut = nucleus_edge(top.data(), (int64_t)top.size(), need);
  }
  if (min_p > 0) cut = std::max(cut, (float)min_p);
  const float keep = cut > 0 ? cut : 0x1p-149f;  // w > 0 at least

  // the inverse CDF over the kept w in vocabulary order: block sums, then the block's values
  constexpr int64_t B = 1024;
  const int64_t nb = (V + B - 1) / B;
  std::vector<double> bs((size_t)nb, 0.0);
  double total = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t e = std::min(V, (b + 1) * B);
    double l[L] = {0};
    int64_t k = b * B;
    for (; k + L <= e; k += L)
      for (int j = 0; j < L; ++j) l[j] += w[k + j] >= keep ? w[k + j] : 0.0f;
    double s = 0;
    for (; k < e; ++k) s += w[k] >= keep ? w[k] : 0.0f;
    for (int j = 0; j < L; ++j) s += l[j];
    bs[(size_t)b] = s;
    total += s;
  }
  const double target = u * total;
  double run = 0;
  int64_t b = 0;
  while (b < nb - 1 && run + bs[(size_t)b] <= target) run += bs[(size_t)b++];
  int64_t last = -1;
  for (int64_t k = b * B; k < V; ++k) {
    if (w[k] < keep) continue;
    run += w[k];
    last = k;
    if (run > target) return k;
  }
  if (last >= 0) return last;  // rounding at the top end: the last kept token
  for (int64_t k = V - 1; k >= 0; --k)
    if (w[k] >= keep) return k;
  return -1;
}


int64_t sample_row(const torch::Tensor& logits, double temperature, int64_t top_k, double top_p, double min_p,
                   double u) {
  TORCH_CHECK_VALUE(logits.dim() == 1 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() &&
                        logits.device().is_cpu() && logits.numel() > 0,
                    "sample_row takes one contiguous float32 CPU row of logits");
  TORCH_CHECK_VALUE(temperature > 0, "temperature must be > 0 (greedy is argmax)");
  TORCH_CHECK_VALUE(top_k >= 0 && top_p > 0 && top_p <= 1 && min_p >= 0 && min_p <= 1 && u >= 0 && u < 1,
                    "need top_k >= 0, 0 < top_p <= 1, 0 <= min_p <= 1, 0 <= u < 1");
  const int64_t V = logits.numel();
  static thread_local Scratch scratch;
  float* w = reinterpret_cast<float*>(scratch.get((size_t)V * sizeof(float)));
  TORCH_CHECK(w != nullptr, "sample_row: out of memory");
  const int64_t tok = sample_core(logits.data_ptr<float>(), V, w, temperature, top_k, top_p, min_p, u);
  TORCH_CHECK_VALUE(tok >= 0, "no token has a finite logit");
  return tok;
}

}  // namespace

void register_sampling(pybind11::module_& m) {
  m.def("sample_row", &sample_row,
        "one token from one row of logits by sampler.py's rule (temperature, top-k, top-p, min-p, inverse CDF at u)",
        py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("u"),
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace ultrafast

// The kernel variants behind the seam of kernel_variant.h, and the choice between them: the fastest the
// CPU runs unless the process asked for another (ULTRAFAST_KERNELS_PATH, set_kernels_path). Compiled for the
// baseline ISA; each variant's own unit checks nothing, so a variant is only handed out after the runtime
// CPU check that its ISA needs.
#include "kernel_variant.h"

#include <atomic>

#include "qmatmul_kernels.h"

namespace ultrafast {
namespace {

// The process-wide request (a path is a property of the process, like the thread count).
std::atomic<bool> g_force_scalar{false};
std::atomic<bool> g_force_fp32{false};

constexpr LinearOps kScalar{"scalar", qmm_prep_bytes_scalar, qmm_prep_units_scalar, qmm_prep_scalar,
                            qmm_rows_scalar};
constexpr LinearOps kAvx512{"avx512-fp32", qmm_prep_bytes_avx512, qmm_prep_units_avx512, qmm_prep_avx512,
                            qmm_rows_avx512};
constexpr LinearOps kVnni{"vnni-int16", qmm_prep_bytes_vnni, qmm_prep_units_vnni, qmm_prep_vnni, qmm_rows_vnni};

bool avx512_cpu() {
  static const bool ok = avx512_usable();
  return ok;
}

bool vnni_cpu() {
  static const bool ok = avx512_usable() && vnni_usable();
  return ok;
}

bool vnni_in_use() {
  return vnni_cpu() && !g_force_scalar.load(std::memory_order_relaxed) &&
         !g_force_fp32.load(std::memory_order_relaxed);
}

}  // namespace

void request_path(PathRequest p) {
  g_force_scalar.store(p == PathRequest::Scalar);
  g_force_fp32.store(p == PathRequest::Fp32);
}

void force_scalar(bool on) { g_force_scalar.store(on); }

bool avx512_in_use() { return avx512_cpu() && !g_force_scalar.load(std::memory_order_relaxed); }

const char* path_in_use() { return vnni_in_use() ? kVnni.name : (avx512_in_use() ? kAvx512.name : kScalar.name); }

const LinearOps* linear_ops(int qt, bool x8) {
  TypeInfo ti;
  if (!type_info(qt, &ti)) return nullptr;
  if (qmm_vnni_supports(qt) && vnni_in_use()) return &kVnni;
  if (x8 && qmm_vnni_supports(qt)) return nullptr;  // int8 activations exist only in the VNNI kernels
  return avx512_in_use() ? &kAvx512 : &kScalar;
}

AttentionOp attention_op(int64_t hd) {
  return avx512_in_use() && hd % 16 == 0 ? attn_group_avx512 : attn_group_scalar;
}

}  // namespace ultrafast

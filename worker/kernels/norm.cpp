// RMSNorm and residual-add + RMSNorm with Hugging Face's rounding (LlamaRMSNorm):
//   y = weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(dtype)
// i.e. statistics in fp32, the normalised value rounded to the storage dtype, then one product with
// the weight rounded again. The fused variant first forms residual + x in the storage dtype (one
// torch add) and normalises that sum, like vLLM's fused_add_rms_norm.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "common.h"
#include "kernels.h"
#include "simd.h"

namespace gearshift {
namespace {

// One row. ``sum_out`` (may alias x or residual) receives x + residual when residual is given;
// ``out`` may alias x. Everything is read into ``tmp`` before anything is written.
template <typename T>
inline void rms_row(
    const T* x,
    const T* residual,
    T* sum_out,
    T* out,
    const T* weight,
    int64_t n,
    float eps,
    float* tmp) {
#if defined(__AVX512F__)
  // The same arithmetic as below, 16 lanes at a time (tails through masks).
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t lanes = std::min<int64_t>(16, n - i);
    const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
    __m512 v = simd::load16(x + i, lanes);
    if (residual != nullptr) {
      v = simd::round16<T>(_mm512_add_ps(v, simd::load16(residual + i, lanes)));
      simd::store16(sum_out + i, v, lanes);
    }
    _mm512_mask_storeu_ps(tmp + i, mask, v);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float inv =
      1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + eps);
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t lanes = std::min<int64_t>(16, n - i);
    const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
    const __m512 y = simd::round16<T>(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, tmp + i), vinv));
    simd::store16(out + i, _mm512_mul_ps(simd::load16(weight + i, lanes), y), lanes);
  }
#else
  if (residual != nullptr) {
    for (int64_t i = 0; i < n; ++i) {
      tmp[i] = Io<T>::round(Io<T>::load(x[i]) + Io<T>::load(residual[i]));
    }
    for (int64_t i = 0; i < n; ++i) {
      sum_out[i] = Io<T>::store(tmp[i]);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      tmp[i] = Io<T>::load(x[i]);
    }
  }
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    ss += tmp[i] * tmp[i];
  }
  // torch: mean = sum / n, then rsqrt(mean + eps) computed as 1 / sqrt.
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = Io<T>::store(Io<T>::load(weight[i]) * Io<T>::round(tmp[i] * inv));
  }
#endif
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.dim() >= 1, "rms_norm: x needs at least one dimension");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: weight must be [",
              x.size(-1), "], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight dtype ",
              weight.scalar_type(), " != input dtype ", x.scalar_type());
  TORCH_CHECK(weight.is_contiguous(), "rms_norm: weight must be contiguous");
}

// Shared driver: rows of x (+ residual) → sum_out (optional) and out, all addressed by RowIndex.
void rms_norm_rows(
    const at::Tensor& x,
    const at::Tensor* residual,
    const at::Tensor* sum_out,
    const at::Tensor& out,
    const at::Tensor& weight,
    double eps) {
  const int64_t n = x.size(-1);
  if (x.numel() == 0) {
    return;
  }
  const int64_t rows = x.numel() / n;
  const RowIndex xi(x), oi(out);
  const RowIndex ri(residual != nullptr ? *residual : x);
  const RowIndex si(sum_out != nullptr ? *sum_out : x);
  GEARSHIFT_DISPATCH_FLOATING(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* rp = residual != nullptr ? residual->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* sp = sum_out != nullptr ? sum_out->data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    const float feps = static_cast<float>(eps);
    at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      std::vector<float> tmp(n);
      for (int64_t r = begin; r < end; ++r) {
        rms_row<scalar_t>(
            xp + xi.offset(r),
            rp != nullptr ? rp + ri.offset(r) : nullptr,
            sp != nullptr ? sp + si.offset(r) : nullptr,
            op + oi.offset(r),
            wp,
            n,
            feps,
            tmp.data());
      }
    });
  });
}

void check_same_shape(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.sizes() == b.sizes(), what, ": shape ", b.sizes(), " != ", a.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), what, ": dtype ", b.scalar_type(), " != ",
              a.scalar_type());
  TORCH_CHECK(b.device().is_cpu(), what, ": CPU tensors only");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  at::Tensor out = at::empty(x.sizes(), x.options());
  rms_norm_rows(x, nullptr, nullptr, out, weight, eps);
  return out;
}

at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_norm_args(x, weight);
  check_same_shape(x, residual, "add_rms_norm residual");
  at::Tensor out = at::empty(x.sizes(), x.options());
  rms_norm_rows(x, &residual, &x, out, weight, eps);
  return out;
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_norm_args(x, weight);
  check_same_shape(x, residual, "fused_add_rms_norm residual");
  rms_norm_rows(x, &residual, &residual, x, weight, eps);
}

}  // namespace gearshift

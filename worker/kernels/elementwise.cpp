// Rotary embedding (rotate-half) and SiLU-and-mul, rounded like Hugging Face's eager code: every
// torch op there rounds its result to the storage dtype, so each product, sum and activation here
// is rounded at the same points.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "common.h"
#include "kernels.h"
#include "simd.h"

namespace gearshift {
namespace {

// One token: ``heads`` rows of ``dim`` values starting ``head_stride`` apart, rotated with this
// token's cos/sin (dim / 2 values each). src and dst may be the same memory.
template <typename T>
inline void rotate_token(
    const T* src,
    T* dst,
    int64_t heads,
    int64_t src_head_stride,
    int64_t dst_head_stride,
    int64_t dim,
    const T* cos,
    const T* sin) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* x = src + h * src_head_stride;
    T* y = dst + h * dst_head_stride;
    int64_t i = 0;
#if defined(__AVX512F__)
    // The same arithmetic as the scalar loop, 16 pairs at a time (the tail through masks).
    for (; i < half; i += 16) {
      const int64_t lanes = std::min<int64_t>(16, half - i);
      const __m512 c = simd::load16(cos + i, lanes), s = simd::load16(sin + i, lanes);
      const __m512 x1 = simd::load16(x + i, lanes), x2 = simd::load16(x + i + half, lanes);
      const __m512 y1 = _mm512_sub_ps(simd::round16<T>(_mm512_mul_ps(x1, c)),
                                      simd::round16<T>(_mm512_mul_ps(x2, s)));
      const __m512 y2 = _mm512_add_ps(simd::round16<T>(_mm512_mul_ps(x2, c)),
                                      simd::round16<T>(_mm512_mul_ps(x1, s)));
      simd::store16(y + i, y1, lanes);
      simd::store16(y + i + half, y2, lanes);
    }
#endif
    for (; i < half; ++i) {
      const float c = Io<T>::load(cos[i]);
      const float s = Io<T>::load(sin[i]);
      const float x1 = Io<T>::load(x[i]);
      const float x2 = Io<T>::load(x[i + half]);
      // HF: cat(x1, x2) * cos + cat(-x2, x1) * sin, each product rounded, then the sum.
      const float y1 = Io<T>::round(x1 * c) - Io<T>::round(x2 * s);
      const float y2 = Io<T>::round(x2 * c) + Io<T>::round(x1 * s);
      y[i] = Io<T>::store(y1);
      y[i + half] = Io<T>::store(y2);
    }
  }
}

void check_rotary_args(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(),
              "rotary_embedding: CPU tensors only");
  TORCH_CHECK(x.dim() == 3, "rotary_embedding: x must be [tokens, heads, head_dim], got ",
              x.sizes());
  const int64_t tokens = x.size(0), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0, "rotary_embedding: head_dim must be even, got ", dim);
  TORCH_CHECK(dim <= 1 || x.stride(2) == 1, "rotary_embedding: head_dim must be contiguous");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "rotary_embedding: cos/sin dtype ",
                t->scalar_type(), " != ", x.scalar_type());
    TORCH_CHECK(t->dim() >= 2 && t->size(0) == tokens && t->numel() == tokens * (dim / 2),
                "rotary_embedding: cos/sin must be [tokens, (1,) head_dim/2], got ", t->sizes());
    TORCH_CHECK(t->size(-1) <= 1 || t->stride(-1) == 1,
                "rotary_embedding: cos/sin last dimension must be contiguous");
  }
}

void rotary_rows(const at::Tensor& x, const at::Tensor& out, const at::Tensor& cos,
                 const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  if (x.numel() == 0) {
    return;
  }
  GEARSHIFT_DISPATCH_FLOATING(x.scalar_type(), "rotary_embedding", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* cp = cos.const_data_ptr<scalar_t>();
    const scalar_t* sp = sin.const_data_ptr<scalar_t>();
    const int64_t cs = cos.stride(0), ss = sin.stride(0);
    at::parallel_for(0, tokens, row_grain(heads * dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rotate_token<scalar_t>(xp + t * x.stride(0), op + t * out.stride(0), heads, x.stride(1),
                               out.stride(1), dim, cp + t * cs, sp + t * ss);
      }
    });
  });
}

template <typename T>
inline void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  // Same arithmetic as the scalar loop below, 16 lanes at a time (the tail through masks).
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i < n; i += 16) {
    const int64_t lanes = std::min<int64_t>(16, n - i);
    const bool full = lanes == 16;
    const __m512 g = full ? simd::load16(gate + i) : simd::load16(gate + i, lanes);
    const __m512 u = full ? simd::load16(up + i) : simd::load16(up + i, lanes);
    const __m512 act =
        simd::round16<T>(_mm512_div_ps(g, _mm512_add_ps(one, simd::exp16(simd::neg16(g)))));
    if (full) {
      simd::store16(out + i, _mm512_mul_ps(act, u));
    } else {
      simd::store16(out + i, _mm512_mul_ps(act, u), lanes);
    }
  }
#endif
  for (; i < n; ++i) {
    const float g = Io<T>::load(gate[i]);
    // torch's silu kernel: x / (1 + exp(-x)), rounded to the dtype before the product.
    const float act = Io<T>::round(g / (1.0f + exp_f32(-g)));
    out[i] = Io<T>::store(act * Io<T>::load(up[i]));
  }
}

}  // namespace

void rotary_embedding_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rotary_args(x, cos, sin);
  rotary_rows(x, x, cos, sin);
}

at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rotary_args(x, cos, sin);
  at::Tensor out = at::empty(x.sizes(), x.options());
  rotary_rows(x, out, cos, sin);
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "silu_and_mul: CPU tensors only");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0,
              "silu_and_mul: last dimension must be even (gate | up), got ", x.sizes());
  const int64_t n = x.size(-1) / 2;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  if (out.numel() == 0) {
    return out;
  }
  const int64_t rows = out.numel() / n;
  const RowIndex xi(x);
  GEARSHIFT_DISPATCH_FLOATING(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(2 * n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = xp + xi.offset(r);
        silu_mul_row<scalar_t>(row, row + n, op + r * n, n);
      }
    });
  });
  return out;
}

}  // namespace gearshift

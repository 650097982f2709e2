// Shared helpers for Gearshift's CPU kernels: dtype conversion that the compiler can vectorise,
// a vectorisable exp, strided row addressing, and the dtype dispatch.
//
// Every kernel computes in fp32 and rounds to the storage dtype exactly where Hugging Face's eager
// bf16/fp16 code rounds (each torch op rounds its result), so bf16 outputs match transformers bit
// for bit where the arithmetic is elementwise. The conversions are written as plain integer/float
// code rather than intrinsics so -O3 -march=native turns the row loops into SIMD on any x86/ARM.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace gearshift {

// std::bit_cast is C++20; torch builds extensions as C++17 before 2.13 (seen with 2.11 on the GPU
// machine), so the copy is spelled out. Compilers turn it into a register move.
template <typename To, typename From>
inline To bits_as(From v) {
  static_assert(sizeof(To) == sizeof(From), "bits_as needs equal sizes");
  To out;
  std::memcpy(&out, &v, sizeof(To));
  return out;
}

// Load a value as fp32, store fp32 rounded (nearest-even) to the storage type, and round an fp32
// value to what storing then loading it would give.
template <typename T>
struct Io;

template <>
struct Io<float> {
  static inline float load(const float& v) { return v; }
  static inline float store(float v) { return v; }
  static inline float round(float v) { return v; }
};

template <>
struct Io<c10::BFloat16> {
  static inline float load(const c10::BFloat16& v) {
    return bits_as<float>(static_cast<uint32_t>(v.x) << 16);
  }
  static inline uint16_t round_bits(float v) {
    uint32_t u = bits_as<uint32_t>(v);
    // Same as c10::BFloat16(float): round to nearest even, any NaN becomes the canonical one.
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  }
  static inline c10::BFloat16 store(float v) {
    return c10::BFloat16(round_bits(v), c10::BFloat16::from_bits());
  }
  static inline float round(float v) {
    return bits_as<float>(static_cast<uint32_t>(round_bits(v)) << 16);
  }
};

template <>
struct Io<c10::Half> {
#if defined(__FLT16_MAX__)
  // The compiler's _Float16 converts with the CPU's F16C/AVX512-FP16 instructions (nearest even,
  // like c10::Half) and vectorises.
  static inline float load(const c10::Half& v) {
    return static_cast<float>(bits_as<_Float16>(v.x));
  }
  static inline c10::Half store(float v) {
    return c10::Half(bits_as<uint16_t>(static_cast<_Float16>(v)), c10::Half::from_bits());
  }
  static inline float round(float v) { return static_cast<float>(static_cast<_Float16>(v)); }
#else
  static inline float load(const c10::Half& v) { return static_cast<float>(v); }
  static inline c10::Half store(float v) { return c10::Half(v); }
  static inline float round(float v) { return static_cast<float>(c10::Half(v)); }
#endif
};

// exp(x) in fp32 to ~1 ulp, branch-free so loops over it vectorise (std::exp does not without
// -ffast-math). Cephes' polynomial on x - n*ln2; 2^n is applied in two halves so results between
// the smallest normal and zero come out as denormals, and large x overflows to inf like expf.
// (The clamp is a ternary: std::fmin/fmax's NaN rules stop the vectoriser.)
inline float exp_f32(float x) {
  x = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
  // Round to nearest without a libm call: adding 1.5 * 2^23 pushes the fraction out.
  const float shifter = 12582912.0f;
  float n = (x * 1.44269504088896341f + shifter) - shifter;
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p * r, r, r) + 1.0f;
  int32_t ni = static_cast<int32_t>(n);
  int32_t n1 = ni >> 1;
  int32_t n2 = ni - n1;
  float s1 = bits_as<float>(static_cast<uint32_t>(n1 + 127) << 23);
  float s2 = bits_as<float>(static_cast<uint32_t>(n2 + 127) << 23);
  return p * s1 * s2;
}

// Offsets of the rows of a tensor whose last dimension is contiguous and whose leading dimensions
// may have any strides (slices of a fused QKV output, per-head views): row r → element offset.
struct RowIndex {
  int64_t dims = 0;
  int64_t sizes[8] = {};
  int64_t strides[8] = {};

  explicit RowIndex(const at::Tensor& t) {
    TORCH_CHECK(t.dim() >= 1 && t.dim() <= 9, "expected 1 to 9 dimensions, got ", t.dim());
    TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, "the last dimension must be contiguous");
    // Merge leading dimensions that are contiguous with each other, innermost first.
    for (int64_t d = t.dim() - 2; d >= 0; --d) {
      if (t.size(d) == 1) {
        continue;
      }
      if (dims > 0 && strides[dims - 1] * sizes[dims - 1] == t.stride(d)) {
        sizes[dims - 1] *= t.size(d);
      } else {
        sizes[dims] = t.size(d);
        strides[dims] = t.stride(d);
        ++dims;
      }
    }
  }

  inline int64_t offset(int64_t row) const {
    int64_t off = 0;
    for (int64_t d = 0; d < dims; ++d) {
      off += (row % sizes[d]) * strides[d];
      row /= sizes[d];
    }
    return off;
  }
};

// Rows handled per task so that a task does at least ~16K elements of work: tiny decode batches
// stay on one thread (a fork/join costs more than the work), prefills spread over all threads.
inline int64_t row_grain(int64_t row_elems) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems));
}

}  // namespace gearshift

#define GEARSHIFT_DISPATCH_FLOATING(dtype, name, ...)                                   \
  [&] {                                                                                 \
    switch (dtype) {                                                                    \
      case at::ScalarType::Float: {                                                     \
        using scalar_t = float;                                                         \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      case at::ScalarType::BFloat16: {                                                  \
        using scalar_t = c10::BFloat16;                                                 \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      case at::ScalarType::Half: {                                                      \
        using scalar_t = c10::Half;                                                     \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      default:                                                                          \
        TORCH_CHECK(false, name, ": unsupported dtype ", dtype, " (float32/bf16/fp16)"); \
    }                                                                                   \
  }()

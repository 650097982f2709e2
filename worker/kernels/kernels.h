// Gearshift CPU kernels: the C++ entry points behind the gearshift_cpu:: ops (registration.cpp).
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace gearshift {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// x ← x + residual (the new residual, in x's storage); returns rms_norm(x).
at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps);
// vLLM's semantics: residual ← residual + x; x ← rms_norm(residual).
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);

void rotary_embedding_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

at::Tensor silu_and_mul(const at::Tensor& x);

// torch.argmax(x, dim=-1) of a [rows, n] tensor, as int64 [rows].
at::Tensor argmax_last(const at::Tensor& x);

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping);
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                            const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale);

// A whole decoder layer of a pure-decode step (decode_layer.cpp): (mlp_out, residual stream).
// ``hidden`` is consumed like RMSNorm.add_forward's input when ``residual`` is given.
std::tuple<at::Tensor, at::Tensor> decode_layer(
    at::Tensor& hidden, const std::optional<at::Tensor>& residual,
    const c10::List<std::optional<at::Tensor>>& weights, at::Tensor& k_cache, at::Tensor& v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, double eps, double scale);

}  // namespace gearshift

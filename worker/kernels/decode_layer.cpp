// One Llama decoder layer of a pure-decode step, run end to end in C++ (the CPU analogue of a
// captured CUDA graph): the same kernels, in the same order, with the same rounding as the
// Python layer (worker/model/llama.py), minus the ~17 eager op dispatches per layer between them.
//
//   (add +) RMSNorm → QKV linear (+ bias) → RoPE on q|k (in place) → KV write + paged attention
//   → o_proj (+ bias after it, as RowParallelLinear adds it) → add + RMSNorm → gate|up linear
//   (+ bias) → SiLU-and-mul → down_proj (+ bias after it)
//
// Linears go through the dispatcher to oneDNN's packed matmul (mkldnn::_linear_pointwise) when
// the weight is a pre-packed oneDNN tensor, and to at::linear otherwise, as the Python layers do.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>

#include <optional>
#include <string_view>
#include <tuple>

#include "kernels.h"

namespace gearshift {
namespace {

using LinearPointwise = at::Tensor(const at::Tensor&, const at::Tensor&,
                                   const std::optional<at::Tensor>&, std::string_view,
                                   c10::List<std::optional<at::Scalar>>,
                                   std::optional<std::string_view>);

// Looked up once per process: the schema lookup takes a lock and a hash-map probe.
const c10::TypedOperatorHandle<LinearPointwise>& linear_pointwise() {
  static const c10::TypedOperatorHandle<LinearPointwise> op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<LinearPointwise>();
  return op;
}

// ReplicatedLinear.matmul: the packed oneDNN weight (packed_linear) or F.linear.
at::Tensor matmul(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  if (weight.is_mkldnn()) {
    return linear_pointwise().call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(),
                                   std::string_view(""));
  }
  return at::linear(x, weight, bias);
}

// RowParallelLinear.forward on one rank: the bias is a separate add after the matmul (it follows
// the all-reduce there), so it rounds like that add, not like a bias fused into the matmul.
at::Tensor row_matmul(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  at::Tensor out = matmul(x, weight, std::nullopt);
  return bias.has_value() ? at::add(out, *bias) : out;
}

// Slots of the per-layer weight list (LlamaDecoderLayer.fused_decode_weights builds it).
enum Slot : int64_t {
  kInputNorm,
  kQkvWeight,
  kQkvBias,
  kOWeight,
  kOBias,
  kPostNorm,
  kGateUpWeight,
  kGateUpBias,
  kDownWeight,
  kDownBias,
  kSlots,
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> decode_layer(
    at::Tensor& hidden,
    const std::optional<at::Tensor>& residual,
    const c10::List<std::optional<at::Tensor>>& weights,
    at::Tensor& k_cache,
    at::Tensor& v_cache,
    const at::Tensor& slot_mapping,
    const at::Tensor& block_tables,
    const at::Tensor& seq_lens,
    const at::Tensor& cos,
    const at::Tensor& sin,
    int64_t num_heads,
    double eps,
    double scale) {
  TORCH_CHECK(weights.size() == kSlots, "decode_layer: expected ", static_cast<int64_t>(kSlots),
              " weight slots, got ", weights.size());
  const auto required = [&](Slot s) -> at::Tensor {
    std::optional<at::Tensor> t = weights.get(s);
    TORCH_CHECK(t.has_value(), "decode_layer: weight slot ", static_cast<int64_t>(s),
                " must not be None");
    return *std::move(t);
  };
  TORCH_CHECK(hidden.dim() == 2, "decode_layer: hidden must be [tokens, hidden], got ",
              hidden.sizes());
  const int64_t tokens = hidden.size(0);
  const int64_t kv_heads = k_cache.size(1), head_dim = k_cache.size(3);
  TORCH_CHECK(num_heads > 0 && num_heads % kv_heads == 0, "decode_layer: ", num_heads,
              " query heads for ", kv_heads, " KV heads");

  // LlamaDecoderLayer.forward: the first layer normalises its input, later ones add the residual
  // stream first; either way ``hidden`` then holds the residual stream (the sum lands in it).
  at::Tensor normed = residual.has_value()
                          ? add_rms_norm(hidden, *residual, required(kInputNorm), eps)
                          : rms_norm(hidden, required(kInputNorm), eps);

  // LlamaAttention.forward. q and k sit side by side in the fused output; they are rotated in
  // place there (the Python layer rotates into a copy: the same arithmetic, one buffer less).
  at::Tensor qkv = matmul(normed, required(kQkvWeight), weights.get(kQkvBias));
  const int64_t q_size = num_heads * head_dim, kv_size = kv_heads * head_dim;
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "decode_layer: QKV output ", qkv.sizes(),
              " does not hold ", num_heads, " + 2 x ", kv_heads, " heads of ", head_dim);
  at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + kv_heads, head_dim});
  rotary_embedding_(qk, cos, sin);
  at::Tensor q = qk.narrow(1, 0, num_heads);
  at::Tensor k = qk.narrow(1, num_heads, kv_heads);
  at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, head_dim});
  at::Tensor attn = at::empty({tokens, num_heads, head_dim}, hidden.options());
  paged_decode_attention(attn, q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                         scale);
  at::Tensor out = row_matmul(attn.view({tokens, q_size}), required(kOWeight), weights.get(kOBias));

  // post_attention_layernorm.add_forward: the o_proj output becomes the new residual stream.
  normed = add_rms_norm(out, hidden, required(kPostNorm), eps);
  at::Tensor gate_up = matmul(normed, required(kGateUpWeight), weights.get(kGateUpBias));
  at::Tensor mlp = row_matmul(silu_and_mul(gate_up), required(kDownWeight), weights.get(kDownBias));
  return {mlp, out};
}

}  // namespace gearshift

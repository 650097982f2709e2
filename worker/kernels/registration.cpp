// Op schemas of the gearshift_cpu library and their CPU kernels. Mutated arguments carry alias
// annotations (Tensor(a!)) so the dispatcher and torch.compile-style tracers see the writes.
#include <torch/library.h>

#include "kernels.h"

TORCH_LIBRARY(gearshift_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor residual, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("rotary_embedding(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def(
      "write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping)"
      " -> ()");
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor(b!) k_cache,"
      " Tensor(c!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens,"
      " float scale) -> ()");
  m.def(
      "decode_layer(Tensor(a!) hidden, Tensor? residual, Tensor?[] weights, Tensor(b!) k_cache,"
      " Tensor(c!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor cos,"
      " Tensor sin, int num_heads, float eps, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(gearshift_cpu, CPU, m) {
  m.impl("rms_norm", &gearshift::rms_norm);
  m.impl("add_rms_norm", &gearshift::add_rms_norm);
  m.impl("fused_add_rms_norm", &gearshift::fused_add_rms_norm);
  m.impl("rotary_embedding_", &gearshift::rotary_embedding_);
  m.impl("rotary_embedding", &gearshift::rotary_embedding);
  m.impl("silu_and_mul", &gearshift::silu_and_mul);
  m.impl("argmax", &gearshift::argmax_last);
  m.impl("write_kv", &gearshift::write_kv);
  m.impl("paged_decode_attention", &gearshift::paged_decode_attention);
  m.impl("decode_layer", &gearshift::decode_layer);
}

// decode_layer's weight list may hold oneDNN-packed tensors, whose MkldnnCPU dispatch key outranks
// CPU when the dispatcher picks a kernel from all the arguments: the same kernel serves both.
TORCH_LIBRARY_IMPL(gearshift_cpu, MkldnnCPU, m) {
  m.impl("decode_layer", &gearshift::decode_layer);
}

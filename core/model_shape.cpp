#include "core/model_shape.h"

namespace trainsim {

ModelShape::ModelShape(const ModelConfig& m, bool separate)
    : h(m.hidden_size),
      a(m.num_attention_heads),
      kv_heads(m.num_query_groups > 0 ? m.num_query_groups : m.num_attention_heads),
      f(m.ffn_hidden_size > 0 ? m.ffn_hidden_size : 4 * m.hidden_size),
      V(m.vocab_size),
      s(m.seq_length),
      L(m.num_layers),
      keys(m.seq_length),
      separate_projections(separate),
      swiglu(m.swiglu),
      learned_positions(m.position_embedding_type == PositionEmbedding::learned_absolute),
      tied(!m.untie_embeddings_and_output_weights),
      bias(m.add_bias_linear),
      layernorm(m.normalization == Normalization::layernorm),
      hidden_dropout(m.hidden_dropout > 0),
      attention_dropout(m.attention_dropout > 0),
      attention(m.attention) {}

double ModelShape::params_per_layer() const {
  const double H = h, kv = static_cast<double>(h) / a * kv_heads, F = f;
  const double mlp_in = swiglu ? 2 * F : F;  // gate and up projections
  double p = H * (H + 2 * kv)  // QKV
             + H * H           // attention output projection
             + H * mlp_in      // MLP in
             + F * H;          // MLP out
  if (bias) p += (H + 2 * kv) + H + mlp_in + H;
  p += 2 * (layernorm ? 2 * H : H);  // two norms per layer
  return p;
}

double ModelShape::replicated_params_per_layer() const {
  const double H = h;
  return 2 * (layernorm ? 2 * H : H) + (bias ? 2 * H : 0.0);
}

double ModelShape::embedding_params() const {
  return static_cast<double>(V) * h + (learned_positions ? static_cast<double>(s) * h : 0.0);
}
double ModelShape::output_params() const { return static_cast<double>(V) * h; }
double ModelShape::final_norm_params() const { return layernorm ? 2.0 * h : 1.0 * h; }
double ModelShape::total_params() const {
  return L * params_per_layer() + embedding_params() + final_norm_params() + (tied ? 0.0 : output_params());
}

double ModelShape::layer_weight_matmul_flops(int b) const {
  const double tokens = static_cast<double>(b) * s;
  const double H = h, kv = static_cast<double>(h) / a * kv_heads, F = f;
  const double mlp = (swiglu ? 3.0 : 2.0) * H * F;
  return 2.0 * tokens * (H * (H + 2 * kv) + H * H + mlp);
}

double ModelShape::layer_attention_core_flops(int b) const {
  // QK^T: a heads x (s x d) x (d x keys) and softmax(QK^T) V: the same size; d = h / a.
  return 2.0 * 2.0 * static_cast<double>(b) * s * keys * h;
}

double ModelShape::layer_forward_flops(int b) const {
  return layer_weight_matmul_flops(b) + layer_attention_core_flops(b);
}

double ModelShape::lm_head_forward_flops(int b) const { return 2.0 * static_cast<double>(b) * s * h * V; }

double ModelShape::model_flops_per_sample() const {
  return 3.0 * (L * layer_forward_flops(1) + lm_head_forward_flops(1));
}

std::vector<LayerProduct> ModelShape::layer_products() const {
  const double H = h, kv = static_cast<double>(h) / a * kv_heads, F = f;
  std::vector<LayerProduct> p;
  if (separate_projections) {
    p = {{H, H}, {kv, H}, {kv, H}};
  } else {
    p = {{H + 2 * kv, H}};
  }
  p.push_back({H, H, true});
  if (swiglu && separate_projections) {
    p.push_back({F, H});
    p.push_back({F, H});
  } else {
    p.push_back({swiglu ? 2 * F : F, H});
  }
  p.push_back({H, F, true});
  return p;
}

double ModelShape::hardware_flops_per_sample(Recompute r, int rebuilt_layers) const {
  double again = 0;
  switch (r) {
    case Recompute::none: break;
    case Recompute::full: again = layer_forward_flops(1); break;
    case Recompute::selective: again = layer_attention_core_flops(1); break;
    case Recompute::selective_op: {
      const std::vector<LayerProduct> products = layer_products();
      for (std::size_t i = 0; i < products.size(); ++i)
        if (!op_policy_keeps(i)) again += 2.0 * s * products[i].out * products[i].in;
      if (!single_kernel_attention(attention)) again += layer_attention_core_flops(1);
      break;
    }
  }
  return model_flops_per_sample() + (rebuilt_layers >= 0 ? rebuilt_layers : L) * again;
}

double ModelShape::layer_activation_bytes(int b, int e, int t, bool sp, Recompute r) const {
  return activation_bytes(b, e, t, sp, r, false);
}

double ModelShape::layer_stored_activation_bytes(int b, int e, int t, bool sp, Recompute r) const {
  return activation_bytes(b, e, t, sp, r, single_kernel_attention(attention));
}

double ModelShape::activation_bytes(int b, int e, int t, bool sp, Recompute r, bool flash) const {
  const double sbh = static_cast<double>(s) * b * h;
  const double as2b = static_cast<double>(a) * s * keys * b;  // the score matrix: s x keys
  const double kv_frac = static_cast<double>(kv_heads) / a;
  const double ffn_ratio = static_cast<double>(f) / h;
  if (r == Recompute::full) return e * sbh / (sp ? t : 1);  // the layer's input only
  if (r == Recompute::selective_op) {
    // The layer's input and the attention core's output (with flash its log-sum-exp; an unfused
    // core's probabilities are rebuilt from the kept q and k), and the kept products' outputs: a
    // row-parallel one the stream's width (split only under sequence parallelism), the others 1/t.
    // Dropout masks are drawn again from the saved RNG state.
    double kept = e * sbh / (sp ? t : 1) + e * sbh / t;
    if (flash) kept += 4.0 * a * static_cast<double>(s) * b / t;
    const std::vector<LayerProduct> products = layer_products();
    for (std::size_t i = 0; i < products.size(); ++i)
      if (op_policy_keeps(i))
        kept += e * static_cast<double>(s) * b * products[i].out / (products[i].row_parallel ? (sp ? t : 1) : t);
    return kept;
  }
  // Replicated across tensor-parallel ranks unless sequence parallel: the two norms' inputs,
  // the QKV and MLP inputs (e bytes each) and two 1-byte dropout masks.
  const double replicated = (2 * e + e + e) * sbh + (hidden_dropout ? 2 * sbh : 0.0);
  // Split over t: Q and K (and V) for QK^T, the projection input (the attention's output),
  // the MLP activations (GELU in/out: 2 f/h e, SwiGLU gate, up and product: 3 f/h e), plus
  // the attention core's own:
  //  * flash: no s x s matrix, only the softmax's log-sum-exp per row (FP32, a*s*b); its
  //    backward recomputes the scores, and attention dropout's mask is regenerated from the
  //    RNG state (Dao et al. 2022);
  //  * fused and naive: the s^2 softmax output (e), with attention dropout also its mask (1)
  //    and output (e), unless selective recompute rebuilds them. Both keep the same tensors
  //    (a softmax saves only its output); they differ in time, not memory.
  const double qkv = (1 + kv_frac) * e * sbh + kv_frac * e * sbh;
  const double proj_in = e * sbh;
  const double mlp = (swiglu ? 3.0 : 2.0) * ffn_ratio * e * sbh;
  double split = qkv + proj_in + mlp;
  if (flash)
    split += 4.0 * a * static_cast<double>(s) * b;
  else if (r == Recompute::none)
    split += (attention_dropout ? 2.0 * e + 1.0 : e) * as2b;
  // PyTorch's sequence parallelism (DTensor, as torchtitan plans it) gathers the norms' outputs
  // for q, k, v and the MLP's first products, which save the gathered rows: only the norms' inputs
  // and the dropout masks are the shard's. Megatron-LM's products save the shard's rows and gather
  // them again for the weight gradient.
  if (sp && separate_projections) {
    const double gathered = (e + e) * sbh;
    return (replicated - gathered) / t + gathered + split / t;
  }
  return (sp ? replicated / t : replicated) + split / t;
}

}  // namespace trainsim

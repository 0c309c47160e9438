// The replayed training step (see step_model.h).
#include "kuai/plan/step_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <queue>
#include <set>
#include <stdexcept>
#include <unordered_map>

#include "kuai/core/allocator.h"
#include "kuai/plan/scratch_model.h"

namespace kuai::plan {

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kParameters:
      return "parameters (fp32 master weights)";
    case Kind::kGradients:
      return "gradients";
    case Kind::kOptimizer:
      return "optimizer state (AdamW moments)";
    case Kind::kWeightCasts:
      return "low-precision weight copies";
    case Kind::kActivations:
      return "activations saved for backward";
    case Kind::kActGrads:
      return "activation gradients in flight";
    case Kind::kComm:
      return "communication buffers";
    case Kind::kWorkspace:
      return "kernel workspace";
    case Kind::kData:
      return "data and small state";
    case Kind::kCount:
      break;
  }
  return "?";
}

int64_t ParamShape::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<ParamShape> parameter_shapes(const nn::GPTConfig& config) {
  const nn::GPTConfig c = config.resolved();
  const int64_t C = c.d_model, V = c.vocab_size;
  std::vector<ParamShape> p;
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    p.push_back({std::move(name), std::move(shape)});
  };
  if (!c.is_llama()) {
    add("wte.weight", {V, C});
    add("wpe.weight", {c.seq_len, C});
    for (int64_t i = 0; i < c.n_layer; ++i) {
      const std::string h = fmt::format("h.{}.", i);
      add(h + "ln_1.weight", {C});
      add(h + "ln_1.bias", {C});
      add(h + "attn.c_attn.weight", {3 * C, C});
      add(h + "attn.c_attn.bias", {3 * C});
      add(h + "attn.c_proj.weight", {C, C});
      add(h + "attn.c_proj.bias", {C});
      add(h + "ln_2.weight", {C});
      add(h + "ln_2.bias", {C});
      add(h + "mlp.c_fc.weight", {4 * C, C});
      add(h + "mlp.c_fc.bias", {4 * C});
      add(h + "mlp.c_proj.weight", {C, 4 * C});
      add(h + "mlp.c_proj.bias", {C});
    }
    add("ln_f.weight", {C});
    add("ln_f.bias", {C});
    return p;
  }
  const int64_t H = c.n_head, Hkv = c.kv_heads(), hd = C / H, F = c.ffn();
  add("embed_tokens.weight", {V, C});
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string h = fmt::format("layers.{}.", i);
    add(h + "input_layernorm.weight", {C});
    add(h + "self_attn.qkv_proj.weight", {(H + 2 * Hkv) * hd, C});
    add(h + "self_attn.o_proj.weight", {C, H * hd});
    add(h + "post_attention_layernorm.weight", {C});
    add(h + "mlp.gate_up_proj.weight", {2 * F, C});
    add(h + "mlp.down_proj.weight", {C, F});
  }
  add("norm.weight", {C});
  if (!c.tied()) add("lm_head.weight", {V, C});
  return p;
}

namespace {

int64_t es(DType d) { return static_cast<int64_t>(dtype_size(d)); }

// The caching allocator (kuai/core/allocator.cpp) as bookkeeping: sizes, a free list, counters.
class AllocatorModel {
 public:
  int64_t allocate(int64_t nbytes) {
    const int64_t size = static_cast<int64_t>(Allocator::round_size(static_cast<size_t>(nbytes)));
    auto it = free_.lower_bound(size);
    int64_t cap = size;
    if (it != free_.end() && *it <= size + size / 4) {
      cap = *it;
      free_.erase(it);
    }
    return cap;
  }
  void release(int64_t cap) { free_.insert(cap); }

 private:
  std::multiset<int64_t> free_;
};

// A tensor buffer of the replay: its allocator block, holders, what it is.
struct Buffer {
  int64_t bytes = 0, cap = 0;
  int refs = 0;
  Kind kind = Kind::kActivations;
  std::string label;
};

// A tensor as the model code sees it: a buffer (views share it), the autograd node that made it
// (-1: a leaf that needs no gradient), dtype and size.
struct Ten {
  int buf = -1;
  int node = -1;
  DType dtype = DType::kF32;
  int64_t numel = 0;
};

// An autograd node: its sequence number, the producers of its inputs (-1: none), what it keeps,
// and its vjp (returns one owned buffer per input, -1 for none).
struct Node {
  uint64_t seq = 0;
  std::string name;
  std::vector<int> next;
  std::vector<int> saved;
  std::vector<DType> in_dtype;
  std::vector<int64_t> in_numel;
  std::function<std::vector<int>(const std::vector<int>&)> vjp;
  int param = -1;  // AccumulateGrad of this parameter
  bool released = false;
};

class Replay {
 public:
  explicit Replay(const StepSpec& s) : s_(s), cfg_(s.model.resolved()) {
    params_ = parameter_shapes(cfg_);
    for (size_t i = 0; i < params_.size(); ++i) index_[params_[i].name] = static_cast<int>(i);
    param_buf_.assign(params_.size(), -1);
    grad_.assign(params_.size(), -1);
    accumulator_.assign(params_.size(), -1);
    cast_.assign(params_.size(), Ten{});
  }

  StepModel run();

 private:
  // --- buffers -------------------------------------------------------------------------------
  int alloc(int64_t bytes, Kind kind, std::string label) {
    const int64_t cap = allocator_.allocate(bytes);
    bufs_.push_back({bytes, cap, 1, kind, std::move(label)});
    current_ += cap;
    now_[static_cast<size_t>(kind)] += cap;
    note_peak();
    return static_cast<int>(bufs_.size()) - 1;
  }
  void keep(int b) {
    if (b >= 0) ++bufs_[static_cast<size_t>(b)].refs;
  }
  void drop(int b) {
    if (b < 0) return;
    Buffer& x = bufs_[static_cast<size_t>(b)];
    if (x.refs <= 0) throw std::logic_error("plan: buffer '" + x.label + "' dropped twice");
    if (--x.refs > 0) return;
    current_ -= x.cap;
    now_[static_cast<size_t>(x.kind)] -= x.cap;
    allocator_.release(x.cap);
  }
  void retag(int b, Kind k) {
    Buffer& x = bufs_[static_cast<size_t>(b)];
    now_[static_cast<size_t>(x.kind)] -= x.cap;
    now_[static_cast<size_t>(k)] += x.cap;
    x.kind = k;
  }
  void note_peak() {
    if (current_ <= peak_) return;
    peak_ = current_;
    at_peak_ = now_;
    peak_where_ = where_;
  }
  // A kernel's scratch: taken (several allocations held together) and returned while it runs.
  void scratch(const Scratch& parts) {
    std::vector<int> held;
    int64_t total = 0;
    for (int64_t b : parts)
      if (b > 0) {
        held.push_back(alloc(b, Kind::kWorkspace, "scratch"));
        total += b;
      }
    workspace_max_ = std::max(workspace_max_, total);
    for (int b : held) drop(b);
  }
  void gemm(const Product& p) {
    if (recording_) products_.push_back(p);
    bwd_flops_ += p.flops();
    if (s_.gemm_scratch) scratch({s_.gemm_scratch(p)});
  }

  // --- autograd ------------------------------------------------------------------------------
  int accumulator(int p) {
    if (accumulator_[static_cast<size_t>(p)] < 0) {
      Node n;
      n.seq = seq_++;
      n.name = "AccumulateGrad " + params_[static_cast<size_t>(p)].name;
      n.param = p;
      nodes_.push_back(std::move(n));
      accumulator_[static_cast<size_t>(p)] = static_cast<int>(nodes_.size()) - 1;
    }
    return accumulator_[static_cast<size_t>(p)];
  }
  // A node over inputs `in` (their producers become its edges; a parameter input is given as
  // param index >= 0 in `param_of`), keeping `saved` (each kept once more).
  int node(std::string name, const std::vector<Ten>& in, const std::vector<int>& param_of,
           std::vector<int> saved, std::function<std::vector<int>(const std::vector<int>&)> vjp) {
    Node n;
    n.seq = seq_++;
    n.name = std::move(name);
    for (int b : saved) keep(b);
    n.saved = std::move(saved);
    n.vjp = std::move(vjp);
    nodes_.push_back(std::move(n));
    const int id = static_cast<int>(nodes_.size()) - 1;
    for (size_t i = 0; i < in.size(); ++i) {
      const int p = i < param_of.size() ? param_of[i] : -1;
      const int edge = p >= 0 ? accumulator(p) : in[i].node;
      nodes_[static_cast<size_t>(id)].next.push_back(edge);
      nodes_[static_cast<size_t>(id)].in_dtype.push_back(in[i].dtype);
      nodes_[static_cast<size_t>(id)].in_numel.push_back(in[i].numel);
    }
    ++ops_;
    return id;
  }
  void accumulate_into(int& slot, int g) {
    if (slot < 0) {
      slot = g;
    } else if (bufs_[static_cast<size_t>(slot)].refs == 1) {
      drop(g);  // add_ in place
    } else {
      const int sum = alloc(bufs_[static_cast<size_t>(slot)].bytes, Kind::kActGrads, "grad sum");
      drop(slot);
      drop(g);
      slot = sum;
    }
  }
  void backward(int root_node);
  void accumulate_param(int p, std::vector<int>& grads);

  // --- ops (each mirrors its primitive: outputs, what it saves, its vjp) ----------------------
  Ten leaf_param(int p) const {
    Ten t;
    t.buf = param_buf_[static_cast<size_t>(p)];
    t.dtype = DType::kF32;
    t.numel = params_[static_cast<size_t>(p)].numel();
    return t;
  }
  int param(const std::string& name) const { return index_.at(name); }
  Ten cast(const Ten& x, DType to, const std::string& label);
  // The parameter as an op under autocast sees it: itself (fp32) or its cached cast.
  Ten weight(int p, std::vector<int>& param_of);
  Ten linear(const Ten& x, const std::string& prefix, bool bias, const std::string& label);
  Ten layer_norm(const Ten& x, const std::string& prefix, const std::string& label);
  Ten rms_norm(const Ten& x, const std::string& prefix, const std::string& label);
  Ten add(const Ten& a, const Ten& b, const std::string& label);
  Ten unary(const char* op, const Ten& x, int64_t out_numel, bool saves_input,
            const std::string& label, std::vector<int64_t> shape);
  Ten attention(const Ten& qkv, const std::string& label);
  Ten embedding(const std::string& weight, int64_t rows, const std::string& label);
  int cross_entropy(const Ten& logits);
  void product(std::string what, bool ta, bool tb, int64_t m, int64_t n, int64_t k, DType a,
               DType b, DType c, bool bias, int64_t batch = 1) {
    products_.push_back({std::move(what), ta, tb, m, n, k, batch, a, b, c, bias, 1});
  }
  void pass(std::string what, double bytes) {
    Pass p;
    p.what = std::move(what);
    p.bytes = bytes;
    passes_.push_back(std::move(p));
  }
  void kernel(std::string what, double bytes, std::string kind, std::vector<int64_t> shape,
              DType dtype, DType from, bool backward, bool per_step = false) {
    if (!recording_) return;
    Pass p;
    p.what = std::move(what);
    p.bytes = bytes;
    p.kernel = std::move(kind);
    p.shape = std::move(shape);
    p.dtype = dtype;
    p.from = from;
    p.backward = backward;
    p.per_step = per_step;
    passes_.push_back(std::move(p));
  }

  Ten forward_gpt2(const Ten& tokens);
  Ten forward_llama(const Ten& tokens);
  void micro_batch(int64_t step, int64_t micro);
  void optimizer_step(int64_t step);
  void setup();
  void release_launched();

  const StepSpec& s_;
  nn::GPTConfig cfg_;
  std::vector<ParamShape> params_;
  std::unordered_map<std::string, int> index_;
  std::vector<int> param_buf_, grad_, accumulator_;
  std::vector<Ten> cast_;  // autocast's cached weight casts (this step)
  std::vector<Buffer> bufs_;
  std::vector<Node> nodes_;
  AllocatorModel allocator_;
  uint64_t seq_ = 0;
  int64_t current_ = 0, peak_ = 0, workspace_max_ = 0, ops_ = 0;
  KindBytes now_{}, at_peak_{};
  std::string where_, peak_where_;
  std::vector<Product> products_;
  std::vector<Pass> passes_;
  std::vector<AttentionWork> attention_;
  bool recording_ = false;  // products and passes are recorded for one micro-batch of step 2
  std::vector<SavedRow> saved_;
  int64_t saved_total_ = 0;
  std::vector<int> moments_;
  // DDP / ZeRO
  struct Bucket {
    std::vector<int> params;
    int64_t numel = 0, padded = 0, shard = 0;
    int flat = -1;      // DDP: the bucket's fp32 gradients (persistent); ZeRO-2: this step's
    int pending = 0;    // gradients still to come this step
    bool full = false;  // ZeRO-2: reduce-scattered, freed at the next hook
  };
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;
  int64_t shard_total_ = 0;
  bool last_micro_ = true;
  bool recording_collectives_ = false;
  double bwd_flops_ = 0;  // product FLOPs of the backward so far (when buckets become ready)
  std::vector<StepModel::Collective> collectives_;
  int64_t ops_per_step_ = 0;
};

Ten Replay::cast(const Ten& x, DType to, const std::string& label) {
  Ten y;
  y.buf = alloc(x.numel * es(to), Kind::kActivations, label);
  y.dtype = to;
  y.numel = x.numel;
  const DType from = x.dtype;
  const int64_t n = x.numel;
  y.node = x.node < 0 ? -1 : node("cast", {x}, {}, {}, [this, from, n](const std::vector<int>& g) {
    return std::vector<int>{alloc(n * es(from), Kind::kActGrads, "cast grad")};
  });
  kernel(label + " (cast)", double(n) * double(es(from) + es(to)), "cast", {n}, to, from, false);
  kernel(label + " (cast back of its gradient)", double(n) * double(es(from) + es(to)), "cast", {n},
         from, to, true);
  return y;
}

Ten Replay::weight(int p, std::vector<int>& param_of) {
  if (s_.compute == DType::kF32) {
    param_of.push_back(p);
    return leaf_param(p);
  }
  Ten& c = cast_[static_cast<size_t>(p)];
  if (c.buf < 0) {  // cast once per step, kept until the step's last micro-batch is done
    const int64_t n = params_[static_cast<size_t>(p)].numel();
    c.buf = alloc(n * es(s_.compute), Kind::kWeightCasts, params_[static_cast<size_t>(p)].name);
    c.dtype = s_.compute;
    c.numel = n;
    c.node = node("cast " + params_[static_cast<size_t>(p)].name, {leaf_param(p)}, {p}, {},
                  [this, n](const std::vector<int>&) {
                    return std::vector<int>{alloc(n * 4, Kind::kActGrads, "weight grad fp32")};
                  });
    kernel("weight casts", double(n) * double(4 + es(s_.compute)), "cast", {n}, s_.compute,
           DType::kF32, false, /*per_step=*/true);
    kernel("weight gradient casts", double(n) * double(4 + es(s_.compute)), "cast", {n},
           DType::kF32, s_.compute, true);
  } else {
    // Reused: autocast gives its node (and the parameter's AccumulateGrad) fresh sequence
    // numbers (amp/autocast.cpp), so they run right after this use's consumer in backward.
    nodes_[static_cast<size_t>(c.node)].seq = seq_++;
    for (int e : nodes_[static_cast<size_t>(c.node)].next)  // and the AccumulateGrad after it
      if (e >= 0) nodes_[static_cast<size_t>(e)].seq = seq_++;
  }
  param_of.push_back(-1);
  return c;
}

Ten Replay::linear(const Ten& x_in, const std::string& prefix, bool bias,
                   const std::string& label) {
  const int wp = param(prefix + ".weight");
  const int64_t N = params_[static_cast<size_t>(wp)].shape[0];
  const int64_t K = params_[static_cast<size_t>(wp)].shape[1];
  const int64_t R = x_in.numel / K;
  const DType cd = s_.compute;
  Ten x = x_in;
  const bool cast_x = cd != DType::kF32 && x.dtype != cd;
  if (cast_x) x = cast(x_in, cd, label + " input (" + std::string(dtype_name(cd)) + ")");
  std::vector<int> param_of = {-1};
  const Ten w = weight(wp, param_of);
  std::vector<Ten> in = {x, w};
  if (bias) in.push_back(weight(param(prefix + ".bias"), param_of));
  Ten y;
  y.dtype = cd;
  y.numel = R * N;
  y.buf = alloc(R * N * es(cd), Kind::kActivations, label);
  std::vector<int> saved = {x.buf};
  if (cd != DType::kF32) saved.push_back(w.buf);
  const bool x_needs = x.node >= 0;
  // Linear::vjp: dX = g W (R, K), dW = g^T x (N, K), db = sum of g's rows.
  const Product fwd{label + " forward", false, true, R, N, K, 1, cd, cd, cd, bias, 1};
  const Product dx{label + " dX", false, false, R, K, N, 1, cd, cd, cd, false, 1};
  const Product dw{label + " dW", true, false, N, K, R, 1, cd, cd, cd, false, 1};
  y.node =
      node("linear " + prefix, in, param_of, saved,
           [this, R, N, K, cd, bias, x_needs, prefix, dx, dw](const std::vector<int>&) {
             std::vector<int> out;
             if (x_needs) {
               out.push_back(alloc(R * K * es(cd), Kind::kActGrads, "dx"));
               gemm(dx);
             } else {
               out.push_back(-1);
             }
             out.push_back(alloc(N * K * es(cd), Kind::kActGrads, prefix + " dW"));
             gemm(dw);
             if (bias) {
               const int db = alloc(N * es(cd), Kind::kActGrads, prefix + " db");
               scratch(sum_rows_scratch(R, N, cd));
               kernel("bias gradients", double(R * N * es(cd)), "sum_rows", {R, N}, cd, cd, true);
               out.push_back(db);
             }
             return out;
           });
  gemm(fwd);
  if (cast_x) drop(x.buf);  // dispatch's handle of the cast input; the node keeps it
  return y;
}

Ten Replay::layer_norm(const Ten& x, const std::string& prefix, const std::string& label) {
  const int64_t C = cfg_.d_model, rows = x.numel / C;
  Ten y;
  y.dtype = DType::kF32;
  y.numel = x.numel;
  y.buf = alloc(x.numel * 4, Kind::kActivations, label);
  const int mean = alloc(rows * 4, Kind::kActivations, label + " mean");
  const int rstd = alloc(rows * 4, Kind::kActivations, label + " rstd");
  const int w = param(prefix + ".weight"), b = param(prefix + ".bias");
  y.node = node("layer_norm " + prefix, {x, leaf_param(w), leaf_param(b)}, {-1, w, b},
                {x.buf, mean, rstd}, [this, rows, C](const std::vector<int>&) {
                  std::vector<int> out;
                  out.push_back(alloc(rows * C * 4, Kind::kActGrads, "ln dx"));
                  out.push_back(alloc(C * 4, Kind::kActGrads, "ln dw"));
                  out.push_back(alloc(C * 4, Kind::kActGrads, "ln db"));
                  return out;
                });
  drop(mean);
  drop(rstd);
  kernel("layer_norm", double(x.numel) * (es(x.dtype) + 4), "layer_norm", {rows, C}, x.dtype,
         x.dtype, false);
  kernel("layer_norm backward", double(x.numel) * (es(x.dtype) + 12), "layer_norm", {rows, C},
         x.dtype, x.dtype, true);
  return y;
}

Ten Replay::rms_norm(const Ten& x, const std::string& prefix, const std::string& label) {
  const int64_t C = cfg_.d_model, rows = x.numel / C;
  Ten y;
  y.dtype = DType::kF32;
  y.numel = x.numel;
  y.buf = alloc(x.numel * 4, Kind::kActivations, label);
  const int rstd = alloc(rows * 4, Kind::kActivations, label + " rstd");
  const int w = param(prefix + ".weight");
  y.node = node("rms_norm " + prefix, {x, leaf_param(w)}, {-1, w}, {x.buf, rstd},
                [this, rows, C](const std::vector<int>&) {
                  std::vector<int> out;
                  out.push_back(alloc(rows * C * 4, Kind::kActGrads, "rms dx"));
                  out.push_back(alloc(C * 4, Kind::kActGrads, "rms dw"));
                  return out;
                });
  drop(rstd);
  kernel("rms_norm", double(x.numel) * (es(x.dtype) + 4), "rms_norm", {rows, C}, x.dtype, x.dtype,
         false);
  kernel("rms_norm backward", double(x.numel) * (es(x.dtype) + 12), "rms_norm", {rows, C}, x.dtype,
         x.dtype, true);
  return y;
}

Ten Replay::add(const Ten& a, const Ten& b, const std::string& label) {
  Ten y;
  y.dtype = a.dtype == DType::kF32 || b.dtype == DType::kF32 ? DType::kF32 : a.dtype;
  y.numel = std::max(a.numel, b.numel);
  y.buf = alloc(y.numel * es(y.dtype), Kind::kActivations, label);
  const int64_t an = a.numel, bn = b.numel, yn = y.numel;
  const DType yd = y.dtype;
  y.node = node("add", {a, b}, {}, {}, [this, an, bn, yn, yd](const std::vector<int>& g) {
    std::vector<int> out;
    for (int64_t n : {an, bn}) {
      if (n == yn) {
        keep(g[0]);
        out.push_back(g[0]);
      } else {  // broadcast input: summed over the leading rows
        scratch(sum_rows_scratch(yn / n, n, yd));
        out.push_back(alloc(n * es(yd), Kind::kActGrads, "sum_to"));
      }
    }
    return out;
  });
  kernel("residual add", double(y.numel) * (es(a.dtype) + es(b.dtype) + es(y.dtype)), "add",
         {a.numel}, b.dtype, a.dtype, false);
  if (b.dtype != y.dtype && b.numel == y.numel)  // the branch's gradient cast to its dtype
    kernel("residual gradient casts", double(y.numel) * (es(b.dtype) + es(y.dtype)), "cast",
           {y.numel}, b.dtype, y.dtype, true);
  return y;
}

Ten Replay::unary(const char* op, const Ten& x, int64_t out_numel, bool saves_input,
                  const std::string& label, std::vector<int64_t> shape) {
  Ten y;
  y.dtype = x.dtype;
  y.numel = out_numel;
  y.buf = alloc(out_numel * es(x.dtype), Kind::kActivations, label);
  const int64_t n = x.numel;
  const DType d = x.dtype;
  y.node = node(op, {x}, {}, saves_input ? std::vector<int>{x.buf} : std::vector<int>{},
                [this, n, d](const std::vector<int>&) {
                  return std::vector<int>{alloc(n * es(d), Kind::kActGrads, "dx")};
                });
  kernel(op, double(n + out_numel) * es(d), op, shape, d, d, false);
  kernel(std::string(op) + " backward", double(n + out_numel + (saves_input ? n : 0)) * es(d), op,
         shape, d, d, true);
  return y;
}

Ten Replay::attention(const Ten& qkv, const std::string& label) {
  const int64_t B = s_.batch, T = s_.seq, H = cfg_.n_head, Hkv = cfg_.kv_heads();
  const int64_t d = cfg_.d_model / H;
  const DType cd = s_.compute;
  Ten y;
  y.dtype = cd;
  y.numel = B * T * H * d;
  y.buf = alloc(y.numel * es(cd), Kind::kActivations, label + " output");
  int extra = -1;
  if (s_.flash) {
    extra = alloc(B * H * T * 4, Kind::kActivations, label + " logsumexp (flash)");
  } else {
    extra = alloc(B * H * T * T * es(cd), Kind::kActivations, label + " probabilities (naive)");
  }
  std::vector<int> saved = {qkv.buf, extra};
  if (s_.flash) saved.push_back(y.buf);
  const bool flash = s_.flash;
  const int64_t threads = s_.threads;
  y.node = node(flash ? "flash_attention" : "attention", {qkv}, {}, saved,
                [this, B, T, H, Hkv, d, cd, flash, threads](const std::vector<int>&) {
                  const int g = alloc(B * T * (H + 2 * Hkv) * d * es(cd), Kind::kActGrads, "dqkv");
                  scratch(attention_backward_scratch(flash, B, H, Hkv, T, d, cd, threads));
                  return std::vector<int>{g};
                });
  scratch(attention_forward_scratch(s_.flash, B, H, Hkv, T, d, cd, s_.threads));
  drop(extra);
  if (recording_) {
    AttentionWork w;
    w.flash = s_.flash;
    w.B = B;
    w.H = H;
    w.Hkv = Hkv;
    w.T = T;
    w.d = d;
    w.dtype = cd;
    w.count = 1;
    const double pairs = double(T) * double(T + 1) / 2.0;  // causal
    w.flops_fwd = 4.0 * double(B * H) * pairs * double(d);
    w.flops_bwd = (s_.flash ? 10.0 : 8.0) * double(B * H) * pairs * double(d);
    attention_.push_back(w);
  }
  return y;
}

Ten Replay::embedding(const std::string& weight_name, int64_t rows, const std::string& label) {
  const int p = param(weight_name);
  const int64_t C = cfg_.d_model, V = params_[static_cast<size_t>(p)].shape[0];
  Ten y;
  y.dtype = DType::kF32;
  y.numel = rows * C;
  y.buf = alloc(rows * C * 4, Kind::kActivations, label);
  y.node = node("embedding", {leaf_param(p)}, {p}, {}, [this, V, C](const std::vector<int>&) {
    return std::vector<int>{alloc(V * C * 4, Kind::kActGrads, "embedding dW")};
  });
  kernel("embedding", double(rows * C) * 8, "embedding", {V, C, rows}, DType::kF32, DType::kF32,
         false);
  kernel("embedding backward", double(V * C) * 4 + double(rows * C) * 8, "embedding", {V, C, rows},
         DType::kF32, DType::kF32, true);
  return y;
}

int Replay::cross_entropy(const Ten& logits) {
  const int64_t V = cfg_.vocab_size, R = logits.numel / V;
  const int loss = alloc(4, Kind::kActivations, "loss");
  const int lse = alloc(R * 4, Kind::kActivations, "cross-entropy logsumexp");
  const int count = alloc(4, Kind::kActivations, "cross-entropy count");
  const DType d = logits.dtype;
  const int lbuf = logits.buf;
  const int n = node("cross_entropy", {logits}, {}, {logits.buf, lse, count},
                     [this, lbuf, R, V, d](const std::vector<int>&) {
                       // dlogits takes the logits' buffer when the node alone holds it.
                       if (bufs_[static_cast<size_t>(lbuf)].refs == 1) {
                         keep(lbuf);
                         retag(lbuf, Kind::kActGrads);
                         return std::vector<int>{lbuf};
                       }
                       return std::vector<int>{alloc(R * V * es(d), Kind::kActGrads, "dlogits")};
                     });
  scratch(cross_entropy_scratch(R, V, d, s_.threads));
  drop(lse);
  drop(count);
  kernel("cross_entropy", double(R * V) * es(d), "cross_entropy", {R, V}, d, d, false);
  kernel("cross_entropy backward", double(R * V) * 2 * es(d), "cross_entropy", {R, V}, d, d, true);
  drop(loss);  // the loss scalar (a few bytes; the trainer keeps it in the metric ring)
  return n;
}

Ten Replay::forward_gpt2(const Ten& tokens) {
  const int64_t B = s_.batch, T = s_.seq;
  (void)tokens;
  // embed: wte(idx) + wpe(arange(T)); the positions are an int32 tensor wpe's node keeps.
  const int positions = alloc(T * 4, Kind::kData, "positions");
  const Ten tok = embedding("wte.weight", B * T, "wte lookup");
  const Ten pos = embedding("wpe.weight", T, "wpe lookup");
  keep(positions);
  nodes_[static_cast<size_t>(pos.node)].saved.push_back(positions);
  Ten x = add(tok, pos, "embedding sum");
  drop(tok.buf);
  drop(pos.buf);
  drop(positions);
  for (int64_t i = 0; i < cfg_.n_layer; ++i) {
    const std::string h = fmt::format("h.{}.", i);
    where_ = fmt::format("forward of h.{}", i);
    // h = x + attn(ln_1(x)): ln_1's output lives until the statement ends.
    const Ten a = layer_norm(x, h + "ln_1", "h.*.ln_1 output");
    const Ten qkv = linear(a, h + "attn.c_attn", true, "h.*.attn.c_attn output (q, k, v)");
    const Ten y = attention(qkv, "h.*.attn");
    const Ten o = linear(y, h + "attn.c_proj", true, "h.*.attn.c_proj output");
    drop(qkv.buf);
    drop(y.buf);
    const Ten h1 = add(x, o, "h.*.residual 1");
    drop(o.buf);
    drop(a.buf);
    // h1 + mlp(ln_2(h1)): c_proj(gelu(c_fc(.))) in one expression.
    const Ten a2 = layer_norm(h1, h + "ln_2", "h.*.ln_2 output");
    const Ten f = linear(a2, h + "mlp.c_fc", true, "h.*.mlp.c_fc output (gelu input)");
    const Ten g = unary("gelu", f, f.numel, true, "h.*.mlp.gelu output", {f.numel});
    const Ten o2 = linear(g, h + "mlp.c_proj", true, "h.*.mlp.c_proj output");
    drop(f.buf);
    drop(g.buf);
    const Ten h2 = add(h1, o2, "h.*.residual 2");
    drop(o2.buf);
    drop(a2.buf);
    drop(h1.buf);
    drop(x.buf);
    x = h2;
  }
  where_ = "forward of the head";
  const Ten lf = layer_norm(x, "ln_f", "ln_f output");
  const Ten logits = linear(lf, "wte", false, "logits");
  drop(lf.buf);
  drop(x.buf);
  return logits;
}

Ten Replay::forward_llama(const Ten& tokens) {
  const int64_t B = s_.batch, T = s_.seq;
  (void)tokens;
  Ten x = embedding("embed_tokens.weight", B * T, "embed_tokens lookup");
  for (int64_t i = 0; i < cfg_.n_layer; ++i) {
    const std::string h = fmt::format("layers.{}.", i);
    where_ = fmt::format("forward of layers.{}", i);
    const Ten n1 = rms_norm(x, h + "input_layernorm", "layers.*.input_layernorm output");
    // project(): qkv_proj's output is rotated into a new buffer and dies with project's locals.
    const Ten qkv = linear(n1, h + "self_attn.qkv_proj", false, "layers.*.qkv_proj output");
    const int64_t H = cfg_.n_head, Hkv = cfg_.kv_heads(), hd = cfg_.d_model / H;
    const Ten r = unary("rope", qkv, qkv.numel, false, "layers.*.rope output (q, k, v)",
                        {s_.batch, s_.seq, H + 2 * Hkv, hd});
    if (recording_)
      for (size_t j = passes_.size() - 2; j < passes_.size(); ++j) {
        passes_[j].theta = cfg_.rope_theta;
        passes_[j].rotated = H + Hkv;
      }
    drop(qkv.buf);
    const Ten y = attention(r, "layers.*.self_attn");
    drop(r.buf);
    const Ten o = linear(y, h + "self_attn.o_proj", false, "layers.*.o_proj output");
    drop(y.buf);
    const Ten h1 = add(x, o, "layers.*.residual 1");
    drop(o.buf);
    drop(n1.buf);
    const Ten n2 =
        rms_norm(h1, h + "post_attention_layernorm", "layers.*.post_attention_layernorm output");
    const Ten gu =
        linear(n2, h + "mlp.gate_up_proj", false, "layers.*.gate_up_proj output (swiglu input)");
    const Ten sw = unary("swiglu", gu, gu.numel / 2, true, "layers.*.swiglu output",
                         {gu.numel / (2 * cfg_.ffn()), 2 * cfg_.ffn()});
    const Ten d = linear(sw, h + "mlp.down_proj", false, "layers.*.down_proj output");
    drop(gu.buf);
    drop(sw.buf);
    const Ten h2 = add(h1, d, "layers.*.residual 2");
    drop(d.buf);
    drop(n2.buf);
    drop(h1.buf);
    drop(x.buf);
    x = h2;
  }
  where_ = "forward of the head";
  const Ten nf = rms_norm(x, "norm", "norm output");
  const Ten logits = linear(nf, cfg_.tied() ? "embed_tokens" : "lm_head", false, "logits");
  drop(nf.buf);
  drop(x.buf);
  return logits;
}

void Replay::accumulate_param(int p, std::vector<int>& grads) {
  const int g = grads.empty() ? -1 : grads[0];
  if (g < 0) return;
  grads[0] = -1;  // AccumulateGrad takes it
  const size_t pi = static_cast<size_t>(p);
  if (grad_[pi] == -1) {
    if (bufs_[static_cast<size_t>(g)].refs == 1) {
      grad_[pi] = g;
      retag(g, Kind::kGradients);
    } else {
      grad_[pi] = alloc(params_[pi].numel() * 4, Kind::kGradients, params_[pi].name + " grad");
      drop(g);
    }
  } else {
    drop(g);  // add_ into the gradient (DDP: its bucket view)
  }
  if (buckets_.empty()) return;
  // The grad-ready hook (distributed/ddp.cpp on_grad).
  Bucket& b = buckets_[static_cast<size_t>(bucket_of_[pi])];
  if (s_.zero == 2) {  // place(): the bucket on its first gradient; the gradient moves in
    if (b.flat < 0) {
      b.flat = alloc(b.padded * 4, Kind::kGradients, "ZeRO-2 gradient bucket");
      for (int q : b.params) {  // the adopted gradient is copied in and let go
        if (grad_[static_cast<size_t>(q)] >= 0) drop(grad_[static_cast<size_t>(q)]);
        grad_[static_cast<size_t>(q)] = -2;
      }
    }
  }
  if (!last_micro_) return;
  if (--b.pending == 0) {
    const size_t bi = static_cast<size_t>(bucket_of_[pi]);
    if (recording_collectives_) {
      StepModel::Collective c;
      c.op = s_.zero == 2 ? "reduce_scatter" : "all_reduce";
      c.what = fmt::format("{} bucket {}", c.op, bi);
      c.bytes = double(b.padded) * (s_.compression == "none" || s_.zero == 2 ? 4.0 : 2.0);
      c.ready_fraction = bwd_flops_;  // divided by the backward's total at its end
      collectives_.push_back(c);
    }
    // ZeRO-2: buckets launched at an earlier hook have completed and are freed.
    if (s_.zero == 2) {
      release_launched();
      b.full = true;
    }
  } else if (s_.zero == 2) {
    release_launched();
  }
}

void Replay::release_launched() {
  for (Bucket& b : buckets_)
    if (b.full && b.flat >= 0) {
      drop(b.flat);
      b.flat = -1;
      b.full = false;
      for (int q : b.params) grad_[static_cast<size_t>(q)] = -1;
    }
}

void Replay::backward(int root) {
  std::unordered_map<int, int> deps;
  {
    std::vector<int> stack{root};
    std::set<int> seen{root};
    while (!stack.empty()) {
      const int n = stack.back();
      stack.pop_back();
      for (int e : nodes_[static_cast<size_t>(n)].next) {
        if (e < 0) continue;
        ++deps[e];
        if (seen.insert(e).second) stack.push_back(e);
      }
    }
  }
  auto later_first = [this](int a, int b) {
    return nodes_[static_cast<size_t>(a)].seq < nodes_[static_cast<size_t>(b)].seq;
  };
  std::priority_queue<int, std::vector<int>, decltype(later_first)> ready(later_first);
  std::unordered_map<int, std::vector<int>> buffers;
  buffers[root] = {alloc(4, Kind::kActGrads, "backward seed")};
  ready.push(root);
  bwd_flops_ = 0;
  while (!ready.empty()) {
    const int id = ready.top();
    ready.pop();
    std::vector<int> grads = std::move(buffers[id]);
    buffers.erase(id);
    Node& n = nodes_[static_cast<size_t>(id)];
    where_ = "backward of " + n.name;
    bool any = false;
    for (int g : grads) any = any || g >= 0;
    std::vector<int> out;
    if (n.param >= 0) {
      accumulate_param(n.param, grads);
    } else if (any) {
      out = n.vjp(grads);
    }
    ++ops_;
    for (int b : n.saved) drop(b);  // release(): a node that saved nothing (a cast) may run again
    n.saved.clear();
    for (size_t i = 0; i < n.next.size(); ++i) {
      const int e = n.next[i];
      const int g = i < out.size() ? out[i] : -1;
      if (e < 0) {
        drop(g);
        continue;
      }
      if (g >= 0) {
        std::vector<int>& buf = buffers[e];
        if (buf.empty()) buf.assign(1, -1);
        accumulate_into(buf[0], g);
      }
      if (--deps[e] == 0) ready.push(e);
    }
    for (int g : grads) drop(g);
  }
}

void Replay::micro_batch(int64_t step, int64_t micro) {
  where_ = fmt::format("forward, micro-batch {} of step {}", micro + 1, step + 1);
  last_micro_ = micro + 1 == s_.accum;
  // Parameters whose graph died with the previous micro-batch get new accumulators; those behind
  // a cached weight cast keep theirs (the cast's node holds it).
  for (size_t p = 0; p < params_.size(); ++p)
    if (cast_[p].buf < 0) accumulator_[p] = -1;
  if (!buckets_.empty() && last_micro_)
    for (Bucket& b : buckets_) b.pending = static_cast<int>(b.params.size());
  const Ten tokens;
  const Ten logits = cfg_.is_llama() ? forward_llama(tokens) : forward_gpt2(tokens);
  int root = cross_entropy(logits);
  drop(logits.buf);
  if (s_.accum > 1 || s_.fp16_scaler) {  // loss * factor
    Ten l;
    l.node = root;
    l.numel = 1;
    root = node("scale", {l}, {}, {}, [this](const std::vector<int>&) {
      return std::vector<int>{alloc(4, Kind::kActGrads, "scaled seed")};
    });
  }
  if (last_micro_ && step == 1) {  // the table of what the forward keeps for backward
    std::map<std::string, SavedRow> rows;
    for (const Buffer& b : bufs_)
      if (b.refs > 0 && b.kind == Kind::kActivations) {
        SavedRow& r = rows[b.label];
        r.what = b.label;
        ++r.count;
        r.bytes += b.cap;
        saved_total_ += b.cap;
      }
    for (auto& [k, r] : rows) saved_.push_back(r);
    std::sort(saved_.begin(), saved_.end(),
              [](const SavedRow& a, const SavedRow& b) { return a.bytes > b.bytes; });
  }
  recording_collectives_ = last_micro_ && step == 1;
  backward(root);
  if (recording_collectives_)
    for (auto& c : collectives_)
      if (c.op != "all_gather")
        c.ready_fraction = bwd_flops_ > 0 ? c.ready_fraction / bwd_flops_ : 1.0;
  recording_collectives_ = false;
  if (last_micro_ && s_.zero == 2) {  // finish_backward: every bucket reduce-scattered
    for (Bucket& b : buckets_) b.full = b.flat >= 0 || b.full;
    release_launched();
  }
}

void Replay::optimizer_step(int64_t step) {
  where_ = fmt::format("optimizer, step {}", step + 1);
  // The autocast guard ends: the weight casts go.
  for (Ten& c : cast_)
    if (c.buf >= 0) {
      drop(c.buf);
      c = Ten{};
    }
  const bool record = step == 1;
  int64_t numel = 0;
  for (const ParamShape& p : params_) numel += p.numel();
  const int64_t updated = s_.zero > 0 ? shard_total_ : numel;
  if (s_.zero == 0 && moments_.empty()) {
    // AdamW's moments, made on its first step: the decayed group's parameters, then the rest.
    for (int pass_no = 0; pass_no < 2; ++pass_no)
      for (size_t p = 0; p < params_.size(); ++p) {
        const ParamShape& ps = params_[p];
        const bool decayed = ps.shape.size() == 2 && ps.name.ends_with(".weight") &&
                             !ps.name.starts_with("wte.") && !ps.name.starts_with("wpe.") &&
                             !ps.name.starts_with("embed_tokens.");
        if (decayed != (pass_no == 0)) continue;
        moments_.push_back(alloc(ps.numel() * 4, Kind::kOptimizer, "exp_avg"));
        moments_.push_back(alloc(ps.numel() * 4, Kind::kOptimizer, "exp_avg_sq"));
      }
  }
  if (record) {
    if (s_.fp16_scaler) pass("loss scaler: unscale and check", double(numel) * 8);
    pass("gradient norm", double(s_.zero == 2 ? shard_total_ : numel) * 4);
    pass("AdamW update", double(updated) * 28);
    ops_ += static_cast<int64_t>(params_.size()) * 2;
  }
  if (s_.zero > 0 && s_.ranks > 1) {  // all-gather of the updated shards (distributed/zero.cpp)
    const int64_t chunk = std::min<int64_t>(shard_total_, int64_t{1} << 22);
    const int send = alloc(4 * chunk, Kind::kComm, "ZeRO all-gather send");
    const int all = alloc(4 * s_.ranks * chunk, Kind::kComm, "ZeRO all-gather receive");
    if (record) {
      const int64_t calls = (shard_total_ + chunk - 1) / chunk;
      for (int64_t c = 0; c < calls; ++c)
        collectives_.push_back({fmt::format("all_gather parameters {}", c), "all_gather",
                                double(4 * s_.ranks * chunk), 1.0});
      pass("ZeRO parameter copy-back", double(numel) * 8);
    }
    drop(all);
    drop(send);
  }
  // zero_grad: alone, gradients go back to none; DDP's stay views of the buckets.
  for (size_t p = 0; p < params_.size(); ++p)
    if (grad_[p] >= 0) {
      drop(grad_[p]);
      grad_[p] = -1;
    }
  if (record && s_.ranks > 1) {
    collectives_.push_back({"all_reduce loss", "all_reduce", 4, 1.0});
    collectives_.push_back({"all_reduce stop flag", "all_reduce", 4, 1.0});
    if (s_.zero == 2)
      collectives_.push_back({"all_gather gradient norm", "all_gather", double(8 * s_.ranks), 1.0});
    if (s_.zero == 2 && s_.fp16_scaler)
      collectives_.push_back({"all_reduce found_inf", "all_reduce", 4, 1.0});
  }
}

void Replay::setup() {
  where_ = "setup";
  for (size_t p = 0; p < params_.size(); ++p)
    param_buf_[p] = alloc(params_[p].numel() * 4, Kind::kParameters, params_[p].name);
  if (s_.ranks > 1) {
    // DDP's buckets (distributed/ddp.cpp): reverse registration order, the first capped at
    // first_bucket_mb, the others at bucket_mb, each padded to a multiple of the world size.
    bucket_of_.assign(params_.size(), -1);
    int64_t filled = 0;
    for (int64_t i = static_cast<int64_t>(params_.size()) - 1; i >= 0; --i) {
      const int64_t bytes = params_[static_cast<size_t>(i)].numel() * 4;
      const double cap_mb = buckets_.size() <= 1 ? s_.first_bucket_mb : s_.bucket_mb;
      if (buckets_.empty() || (filled > 0 && double(filled + bytes) > cap_mb * (1 << 20))) {
        buckets_.emplace_back();
        filled = 0;
      }
      buckets_.back().params.push_back(static_cast<int>(i));
      buckets_.back().numel += bytes / 4;
      filled += bytes;
      bucket_of_[static_cast<size_t>(i)] = static_cast<int>(buckets_.size()) - 1;
    }
    std::vector<int> wires;
    for (Bucket& b : buckets_) {
      b.padded = (b.numel + s_.ranks - 1) / s_.ranks * s_.ranks;
      b.shard = b.padded / s_.ranks;
      shard_total_ += b.shard;
      b.flat = alloc(b.padded * 4, Kind::kGradients, "DDP gradient bucket");
      if (s_.compression != "none") {
        wires.push_back(alloc(b.padded * 2, Kind::kComm, "compression wire buffer"));
        if (s_.error_feedback)
          wires.push_back(alloc(b.padded * 4, Kind::kComm, "error-feedback residual"));
      }
    }
    for (size_t p = 0; p < params_.size(); ++p) grad_[p] = -2;  // views of the buckets
    if (s_.zero > 0) {
      const int64_t S = std::max<int64_t>(shard_total_, 1);
      moments_.push_back(alloc(S * 4, Kind::kOptimizer, "ZeRO exp_avg shard"));
      moments_.push_back(alloc(S * 4, Kind::kOptimizer, "ZeRO exp_avg_sq shard"));
      if (s_.zero == 2) {
        moments_.push_back(alloc(S * 4, Kind::kGradients, "ZeRO-2 gradient shard"));
        for (Bucket& b : buckets_) {  // shard_gradients(): the buckets go
          drop(b.flat);
          b.flat = -1;
        }
        for (size_t p = 0; p < params_.size(); ++p) grad_[p] = -1;
      }
    }
  }
  for (int64_t i = 0; i < 2 * s_.loader_slots; ++i)
    alloc(s_.batch * s_.seq * 4, Kind::kData, "loader batch slots");
  peak_ = current_;  // the trainer resets the peak here
  at_peak_ = now_;
  peak_where_ = where_;
}

StepModel Replay::run() {
  if (s_.batch <= 0 || s_.seq <= 0 || s_.accum <= 0 || s_.ranks <= 0)
    throw std::invalid_argument("plan: batch, sequence, accumulation and ranks must be positive");
  setup();
  for (int64_t step = 0; step < 2; ++step) {
    const int64_t ops0 = ops_;
    for (int64_t micro = 0; micro < s_.accum; ++micro) {
      recording_ = step == 1 && micro == 0;
      micro_batch(step, micro);
      recording_ = false;
    }
    optimizer_step(step);
    ops_per_step_ = ops_ - ops0;
  }
  // KUAI_PLAN_DEBUG=1: what is still live after the two steps (what the steps hold across
  // steps, and any buffer the replay failed to let go), one line each, on stderr.
  if (std::getenv("KUAI_PLAN_DEBUG"))
    for (const Buffer& b : bufs_)
      if (b.refs > 0)
        std::cerr << fmt::format("plan: live {} ({} bytes, {} holders, {})\n", b.label, b.cap,
                                 b.refs, kind_name(b.kind));
  StepModel m;
  m.peak_bytes = peak_;
  m.at_peak = at_peak_;
  m.peak_where = peak_where_;
  m.persistent = now_;
  m.saved_total = saved_total_;
  m.saved = saved_;
  m.workspace_max = workspace_max_;
  m.products = products_;
  for (Product& p : m.products) p.count = s_.accum;
  m.passes = passes_;
  for (Pass& p : m.passes)
    if (!p.kernel.empty() && !p.per_step) p.count = s_.accum;
  m.attention = attention_;
  for (AttentionWork& a : m.attention) a.count = s_.accum;
  m.ops_per_step = ops_per_step_;
  m.collectives = collectives_;
  for (const Bucket& b : buckets_) m.grad_bytes_fp32 += double(b.padded) * 4;
  if (buckets_.empty())
    for (const ParamShape& p : params_) m.grad_bytes_fp32 += double(p.numel()) * 4;
  return m;
}

}  // namespace

StepModel model_step(const StepSpec& spec) { return Replay(spec).run(); }

}  // namespace kuai::plan

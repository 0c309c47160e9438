// The DDP reducer (see ddp.h).
#include "kuai/dist/ddp.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "kuai/core/dtype.h"
#include "kuai/core/ops.h"

namespace kuai::dist {

const char* compression_name(Compression c) {
  switch (c) {
    case Compression::kNone:
      return "none";
    case Compression::kFp16:
      return "fp16";
    case Compression::kBf16:
      return "bf16";
  }
  return "?";
}

Compression parse_compression(const std::string& name) {
  for (Compression c : {Compression::kNone, Compression::kFp16, Compression::kBf16})
    if (name == compression_name(c)) return c;
  throw std::invalid_argument("DDP: unknown compression '" + name +
                              "' (one of \"none\", \"fp16\", \"bf16\")");
}

namespace {

// The compression hook of one bucket, run on the communication thread around its all-reduce.
// Chunks of kChunk elements through convert_serial's vectorised conversions.
struct Compressor {
  static constexpr int64_t kChunk = 2048;
  float* grad;      // the bucket (fp32)
  uint16_t* wire;   // its bf16 / f16 copy
  float* residual;  // error feedback, or null
  int64_t n;
  DType wire_dtype;
  float inv_world;

  void before() const {
    float v[kChunk], back[kChunk];
    for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
      const int64_t m = std::min(kChunk, n - i0);
      for (int64_t i = 0; i < m; ++i)
        v[i] = grad[i0 + i] * inv_world + (residual != nullptr ? residual[i0 + i] : 0.0f);
      convert_serial(v, DType::kF32, wire + i0, wire_dtype, m);
      if (residual == nullptr) continue;
      convert_serial(wire + i0, wire_dtype, back, DType::kF32, m);
      for (int64_t i = 0; i < m; ++i) residual[i0 + i] = v[i] - back[i];
    }
  }
  void after() const { convert_serial(wire, wire_dtype, grad, DType::kF32, n); }
};

}  // namespace

struct DistributedDataParallel::State {
  std::shared_ptr<ProcessGroup> group;
  DDPOptions options;
  std::vector<Bucket> buckets;
  std::vector<Tensor> wire, residual;  // per bucket, with compression
  std::vector<int64_t> bucket_of;      // parameter index -> bucket
  std::vector<std::string> names;      // parameter index -> name
  std::vector<int64_t> bucket_size;    // parameters per bucket
  // Per synchronising backward:
  bool sync = true;
  std::vector<int64_t> pending;  // parameters of each bucket not yet ready
  std::vector<char> ready;       // per parameter
  size_t next_launch = 0;        // buckets are launched in order
  std::vector<std::shared_ptr<Work>> works;

  void reset_for_backward() {
    pending = bucket_size;
    std::fill(ready.begin(), ready.end(), 0);
    next_launch = 0;
    works.clear();
  }

  void launch_ready() {
    while (next_launch < buckets.size() && pending[next_launch] == 0) {
      const size_t i = next_launch++;
      if (options.compression == Compression::kNone) {
        works.push_back(group->all_reduce(buckets[i].flat, ReduceOp::kAvg));
        continue;
      }
      const Compressor c{buckets[i].flat.data<float>(),
                         wire[i].data<uint16_t>(),
                         residual.empty() ? nullptr : residual[i].data<float>(),
                         buckets[i].flat.numel(),
                         wire[i].dtype(),
                         1.0f / static_cast<float>(group->size())};
      works.push_back(group->all_reduce(
          wire[i], ReduceOp::kSum, [c] { c.before(); }, [c] { c.after(); }));
    }
  }

  void on_ready(int64_t param) {
    if (!sync || ready[param]) return;
    ready[param] = 1;
    --pending[bucket_of[param]];
    if (options.overlap) launch_ready();
  }
};

DistributedDataParallel::DistributedDataParallel(nn::Module& model,
                                                 std::shared_ptr<ProcessGroup> group,
                                                 const DDPOptions& options)
    : group_(std::move(group)), state_(std::make_shared<State>()) {
  if (options.bucket_mb <= 0 || options.first_bucket_mb <= 0)
    throw std::invalid_argument("DDP: bucket sizes must be positive");
  State& s = *state_;
  s.group = group_;
  s.options = options;
  std::vector<std::pair<std::string, Tensor>> params;
  for (auto& [name, p] : model.named_parameters())
    if (p.requires_grad()) params.emplace_back(name, p);
  for (auto& [name, p] : params)
    if (p.dtype() != DType::kF32 || !p.is_contiguous())
      throw std::invalid_argument("DDP: parameter " + name + " is not contiguous fp32");

  // The same weights on every rank: rank 0's.
  if (group_->size() > 1) {
    std::vector<std::shared_ptr<Work>> works;
    for (auto& [name, p] : params) works.push_back(group_->broadcast(p, 0));
    for (auto& w : works) w->wait();
  }

  // Buckets in reverse registration order: the first small, then bucket_mb each.
  const int64_t n = static_cast<int64_t>(params.size());
  s.bucket_of.assign(static_cast<size_t>(n), -1);
  s.names.resize(static_cast<size_t>(n));
  std::vector<std::vector<int64_t>> members;
  int64_t filled = 0;
  for (int64_t i = n - 1; i >= 0; --i) {
    const int64_t bytes = params[i].second.numel() * 4;
    const double cap_mb = members.size() <= 1 ? options.first_bucket_mb : options.bucket_mb;
    if (members.empty() ||
        (filled > 0 && static_cast<double>(filled + bytes) > cap_mb * (1 << 20))) {
      members.emplace_back();
      filled = 0;
    }
    members.back().push_back(i);
    filled += bytes;
  }
  for (const auto& m : members) {
    int64_t numel = 0;
    for (int64_t i : m) numel += params[i].second.numel();
    Bucket b{zeros({numel}), {}};
    int64_t offset = 0;
    for (int64_t i : m) {
      Tensor& p = params[i].second;
      Shape strides(p.dim(), 1);
      for (int64_t d = p.dim() - 2; d >= 0; --d) strides[d] = strides[d + 1] * p.shape()[d + 1];
      p.set_grad(Tensor::view_of(b.flat, p.shape(), strides, offset));
      offset += p.numel();
      b.names.push_back(params[i].first);
      s.bucket_of[i] = static_cast<int64_t>(s.buckets.size());
      s.names[i] = params[i].first;
    }
    s.bucket_size.push_back(static_cast<int64_t>(m.size()));
    if (options.compression != Compression::kNone) {
      s.wire.push_back(
          zeros({numel}, options.compression == Compression::kBf16 ? DType::kBF16 : DType::kF16));
      if (options.error_feedback) s.residual.push_back(zeros({numel}));
    }
    s.buckets.push_back(std::move(b));
  }
  s.ready.assign(static_cast<size_t>(n), 0);
  s.reset_for_backward();

  // Grad-ready hooks; they hold the state weakly, so a hook outliving this reducer does nothing.
  std::weak_ptr<State> weak = state_;
  for (int64_t i = 0; i < n; ++i) {
    params[i].second.register_hook([weak, i](const Tensor&) {
      if (auto st = weak.lock()) st->on_ready(i);
    });
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  // Collectives still queued read bucket memory: let them finish before it goes.
  for (auto& w : state_->works) {
    try {
      w->wait();
    } catch (const std::exception&) {
    }
  }
}

void DistributedDataParallel::prepare_backward(bool sync) {
  State& s = *state_;
  s.sync = sync;
  if (sync) s.reset_for_backward();
}

void DistributedDataParallel::finish_backward() {
  State& s = *state_;
  if (!s.sync) return;
  std::vector<std::string> missing;
  for (size_t i = 0; i < s.ready.size(); ++i)
    if (!s.ready[i]) missing.push_back(s.names[i]);
  if (!missing.empty()) {
    if (!s.options.find_unused) {
      std::string list;
      for (size_t i = 0; i < missing.size() && i < 8; ++i) list += (i ? ", " : "") + missing[i];
      if (missing.size() > 8) list += fmt::format(" and {} more", missing.size() - 8);
      throw std::runtime_error(fmt::format(
          "DDP: parameter{} {} received no gradient in this backward; every rank must use every "
          "parameter, or set dist.find_unused = true",
          missing.size() > 1 ? "s" : "", list));
    }
    for (size_t i = 0; i < s.ready.size(); ++i)
      if (!s.ready[i]) {
        s.ready[i] = 1;
        --s.pending[s.bucket_of[i]];
      }
  }
  s.launch_ready();  // overlap off: all of them; on: whatever the hooks left
  for (auto& w : s.works) w->wait();
  s.works.clear();
  s.sync = true;
}

void DistributedDataParallel::zero_grad() {
  for (Bucket& b : state_->buckets)
    std::memset(b.flat.raw_data(), 0, static_cast<size_t>(b.flat.nbytes()));
}

const std::vector<DistributedDataParallel::Bucket>& DistributedDataParallel::buckets() const {
  return state_->buckets;
}

int64_t DistributedDataParallel::bytes_per_sync() const {
  int64_t n = 0;
  for (const Bucket& b : state_->buckets) n += b.flat.nbytes();
  return state_->options.compression == Compression::kNone ? n : n / 2;
}

}  // namespace kuai::dist

// kuai::optimize (see optimize.h).
#include "kuai/nn/optimize.h"

namespace kuai {

std::vector<Replaced> optimize(nn::Module& model, nn::AttentionImpl to) {
  std::vector<Replaced> done;
  for (auto& [name, m] : model.named_modules()) {
    auto* attn = dynamic_cast<nn::AttentionModule*>(m);
    if (attn == nullptr || attn->impl() == to) continue;
    done.push_back({name, nn::attention_impl_name(attn->impl()), nn::attention_impl_name(to)});
    attn->set_impl(to);
  }
  return done;
}

}  // namespace kuai

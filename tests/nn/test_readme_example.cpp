// The C++ example of the README, verbatim apart from the test wrapper: it must keep compiling
// and a few steps of it must lower the loss on a fixed batch.
#include <gtest/gtest.h>

#include "kuai/core/ops.h"
#include "kuai/nn/gpt.h"
#include "kuai/optim/adamw.h"
#include "kuai/optim/clip_grad.h"
#include "kuai/train/trainer.h"  // param_groups()

namespace {

using namespace kuai;

TEST(ReadmeExample, TrainsOnAFixedBatch) {
  nn::GPT model({.vocab_size = 256, .n_layer = 4, .n_head = 4, .d_model = 256, .seq_len = 128},
                /*seed=*/1337);
  optim::AdamW opt(train::param_groups(model, /*weight_decay=*/0.1f),
                   {.lr = 1e-3f, .beta2 = 0.95f});
  Generator gen(/*seed=*/0, /*stream=*/0);
  Tensor x = gen.randint({8, 128}, 0, 256), y = gen.randint({8, 128}, 0, 256);

  float first = 0, last = 0;
  for (int step = 0; step < 5; ++step) {
    Tensor loss = model.loss(x, y);  // cross-entropy over (8*128) next-token targets
    loss.backward();                 // fills p.grad() for every parameter
    double norm = optim::grad_norm(model.parameters());
    opt.step(optim::clip_coefficient(norm, 1.0f));  // clipping folded into the AdamW pass
    opt.zero_grad();
    (step == 0 ? first : last) = loss.item();
  }
  EXPECT_LT(last, first - 0.05f);
}

}  // namespace

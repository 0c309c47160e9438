// Naive embedding oracle for the tests: a row copy for the forward; for the backward each used id
// gets a double accumulator row, summed in row order, then rounded once into dW.
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "kuai/backend/cpu/reference.h"

namespace kuai::cpu::ref {

void embedding_forward(const float* W, const int32_t* idx, float* out, int64_t N, int64_t C) {
  for (int64_t i = 0; i < N; ++i)
    for (int64_t c = 0; c < C; ++c) out[i * C + c] = W[static_cast<int64_t>(idx[i]) * C + c];
}

void embedding_backward(const float* dout, const int32_t* idx, float* dW, int64_t N, int64_t C,
                        int64_t V) {
  std::map<int32_t, std::vector<double>> acc;  // id -> (C)
  for (int64_t i = 0; i < N; ++i) {
    if (idx[i] < 0 || idx[i] >= V)
      throw std::out_of_range("embedding_backward: index " + std::to_string(idx[i]) + " at row " +
                              std::to_string(i) + " is outside [0, " + std::to_string(V) + ")");
    std::vector<double>& row = acc[idx[i]];
    row.resize(C, 0.0);
    for (int64_t c = 0; c < C; ++c) row[c] += dout[i * C + c];
  }
  for (int64_t v = 0; v < V; ++v)
    for (int64_t c = 0; c < C; ++c) dW[v * C + c] = 0.0f;
  for (const auto& [v, row] : acc)
    for (int64_t c = 0; c < C; ++c)
      dW[static_cast<int64_t>(v) * C + c] = static_cast<float>(row[c]);
}

}  // namespace kuai::cpu::ref

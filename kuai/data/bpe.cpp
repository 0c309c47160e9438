// The BPE merge loop (see bpe.h).
#include "kuai/data/bpe.h"

#include <algorithm>
#include <functional>

namespace kuai::data {

void bpe_merge(std::vector<int32_t>& sym, const BpeMerges& merges, MergeOrder order) {
  const int32_t n = static_cast<int32_t>(sym.size());
  if (n < 2 || merges.empty()) return;
  std::vector<int32_t> prev(n), next(n);
  for (int32_t k = 0; k < n; ++k) {
    prev[k] = k - 1;
    next[k] = k + 1 < n ? k + 1 : -1;
  }
  struct Candidate {
    int32_t rank, pos, left, right, result;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::vector<Candidate> heap;
  const auto push = [&](int32_t pos) {  // the pair starting at node pos, if it has a rank
    if (pos < 0 || next[pos] < 0) return;
    const auto it = merges.find(bpe_pair_key(sym[pos], sym[next[pos]]));
    if (it == merges.end()) return;
    heap.push_back({it->second.rank, pos, sym[pos], sym[next[pos]], it->second.result});
    std::push_heap(heap.begin(), heap.end(), std::greater<>{});
  };
  // Merges the pair a candidate names; false when it is stale.
  const auto apply = [&](const Candidate& c) {
    const int32_t r = next[c.pos];
    if (sym[c.pos] != c.left || r < 0 || sym[r] != c.right) return false;
    sym[c.pos] = c.result;
    sym[r] = -1;
    next[c.pos] = next[r];
    if (next[r] >= 0) prev[next[r]] = c.pos;
    return true;
  };
  const auto pop = [&] {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
    const Candidate c = heap.back();
    heap.pop_back();
    return c;
  };
  for (int32_t k = 0; k + 1 < n; ++k) push(k);

  std::vector<int32_t> merged_at;
  while (!heap.empty()) {
    if (order == MergeOrder::kBestFirst) {
      const Candidate c = pop();
      if (!apply(c)) continue;
      push(prev[c.pos]);
      push(c.pos);
      continue;
    }
    const int32_t rank = heap.front().rank;
    merged_at.clear();
    while (!heap.empty() && heap.front().rank == rank) {
      const Candidate c = pop();
      if (apply(c)) merged_at.push_back(c.pos);
    }
    // New pairs have other ranks, so they join only after this rank is done.
    for (const int32_t pos : merged_at) {
      push(prev[pos]);
      push(pos);
    }
  }
  int32_t w = 0;
  for (int32_t k = 0; k >= 0; k = next[k]) sym[w++] = sym[k];
  sym.resize(w);
}

}  // namespace kuai::data

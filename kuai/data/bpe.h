// The merge loop of byte-pair encoding, shared by GPT-2's tokenizer and the tokenizer.json reader:
// adjacent symbols (token ids) are merged into the token their pair makes, lowest rank first.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace kuai::data {

struct BpeMerge {
  int32_t rank;    // lower merges first
  int32_t result;  // the token the pair becomes
};
// (left id << 32 | right id) -> its merge.
using BpeMerges = std::unordered_map<uint64_t, BpeMerge>;

inline uint64_t bpe_pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

enum class MergeOrder {
  // GPT-2's loop: every occurrence of the best pair, left to right, before the next rank is
  // looked at (pairs a merge makes wait until that rank is done).
  kRankByRank,
  // The `tokenizers` library's Word::merge_all: the best pair anywhere, leftmost among equal
  // ranks, a pair a merge makes taken as soon as it is the best.
  kBestFirst,
};
// The two orders differ only where merge ranks do not follow the order tokens were made in.

// Merges `symbols` in place, in O(n log n): a linked list over the symbols and a min-heap of
// candidate pairs (rank, position), stale entries skipped when popped.
void bpe_merge(std::vector<int32_t>& symbols, const BpeMerges& merges, MergeOrder order);

}  // namespace kuai::data

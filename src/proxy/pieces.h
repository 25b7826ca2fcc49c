// A region written in pieces: a staged sender posts each piece once the copy engine has brought it out of HBM, and a
// staged receiver copies each piece into HBM once it has landed, so the two copies overlap the wire instead of adding
// to it. A region goes in 1, 2 or 4 pieces; each piece's immediate names its index and the count (one code of 3 bits,
// proxy/imm.h), so a receiver knows how many writes make the region without reading it, whatever memory it uses.
#pragma once
#include <cstdint>

namespace jax_moe::proxy {

constexpr int kMaxPieces = 4;

// The code of piece `index` of `count` (1, 2 or 4): 0 | 1, 2 | 3, 4, 5, 6. Code 0 is a region written whole.
constexpr uint32_t PieceCode(int count, int index) { return uint32_t(count - 1 + index); }
constexpr int kPieceCodes = 7;
constexpr int PieceCountOf(uint32_t code) { return code == 0 ? 1 : code <= 2 ? 2 : 4; }
constexpr int PieceIndexOf(uint32_t code) { return int(code) - (PieceCountOf(code) - 1); }

// How many pieces a region of `bytes` goes in: as many as `max_pieces` (1, 2 or 4) allows with every piece at least
// `min_piece_bytes` long (so no piece is empty, and small regions stay one write).
constexpr int PieceCount(uint64_t bytes, int max_pieces, uint64_t min_piece_bytes) {
  int n = 1;
  while (n < max_pieces && bytes >= uint64_t(2 * n) * min_piece_bytes) n *= 2;
  return n;
}

struct PieceSpan {
  uint64_t begin = 0, end = 0;  // bytes of the region
};
// Piece `index` of `count` of a region of `bytes`: equal parts on 64-byte boundaries, the last one shorter. Computed
// alike by the sender (what it copies and posts) and the receiver (what it copies into HBM). Empty only where `bytes`
// is too short for `count` pieces (a receiver given a count that does not fit the header it read).
constexpr PieceSpan Piece(uint64_t bytes, int count, int index) {
  const uint64_t part = (bytes + uint64_t(count) - 1) / uint64_t(count);
  const uint64_t step = (part + 63) / 64 * 64;
  const uint64_t begin = uint64_t(index) * step;
  const uint64_t end = begin + step;
  return {begin < bytes ? begin : bytes, end < bytes ? end : bytes};
}

}  // namespace jax_moe::proxy

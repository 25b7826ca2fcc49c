// Little-endian byte writer/reader for the wire formats (descriptors, addresses, handshakes).
// The reader never reads past the end: a short buffer sets ok() to false instead.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>

namespace jax_moe {

class ByteWriter {
 public:
  template <typename T>
  void Put(T v) {
    static_assert(std::is_integral<T>::value, "integers only");
    for (size_t i = 0; i < sizeof(T); ++i) out_.push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff));
  }
  void PutBytes(const std::string& s) {
    Put<uint16_t>(static_cast<uint16_t>(s.size()));
    out_.append(s);
  }
  std::string& str() { return out_; }

 private:
  std::string out_;
};

class ByteReader {
 public:
  ByteReader(const void* data, size_t size) : p_(static_cast<const uint8_t*>(data)), n_(size) {}
  explicit ByteReader(const std::string& s) : ByteReader(s.data(), s.size()) {}

  template <typename T>
  T Get() {
    static_assert(std::is_integral<T>::value, "integers only");
    if (n_ - pos_ < sizeof(T) || !ok_) {
      ok_ = false;
      return T{};
    }
    uint64_t v = 0;
    for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(p_[pos_ + i]) << (8 * i);
    pos_ += sizeof(T);
    return static_cast<T>(v);
  }
  std::string GetBytes(size_t max_len) {
    uint16_t len = Get<uint16_t>();
    if (!ok_ || len > max_len || n_ - pos_ < len) {
      ok_ = false;
      return {};
    }
    std::string s(reinterpret_cast<const char*>(p_ + pos_), len);
    pos_ += len;
    return s;
  }
  bool ok() const { return ok_; }
  bool AtEnd() const { return pos_ == n_; }
  size_t pos() const { return pos_; }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
  bool ok_ = true;
};

// FNV-1a 64: a corruption check for wire messages (not a security MAC).
inline uint64_t Fnv1a64(const void* data, size_t size) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < size; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace jax_moe

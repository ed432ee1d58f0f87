// Number formats that appear in a plan: compute precision, master weights, gradient
// accumulation and all-reduce.
#pragma once

#include <array>
#include <cstddef>
#include <initializer_list>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <type_traits>
#include <utility>

namespace trainsim {

enum class DType { fp32, tf32, fp16, bf16, fp8 };

inline constexpr DType kAllDTypes[] = {DType::fp32, DType::tf32, DType::fp16, DType::bf16, DType::fp8};

inline constexpr std::size_t kNumDTypes = std::size(kAllDTypes);
static_assert(static_cast<std::size_t>(kAllDTypes[kNumDTypes - 1]) == kNumDTypes - 1, "kAllDTypes in enum order");

// A value per format, for the formats it holds: std::map<DType, T>'s interface (find, [], at,
// iteration in format order with `.first` and `.second`, ==) in one fixed array, without
// nodes: a ScenarioConfig holds one (the cluster's peak rates) and a sweep copies the
// configuration per row.
template <class T>
class DTypeMap {
 public:
  using key_type = DType;
  using mapped_type = T;
  using value_type = std::pair<DType, T>;  // `first` is the slot's format: do not change it

  template <bool Const>
  class Iter {
   public:
    using Map = std::conditional_t<Const, const DTypeMap, DTypeMap>;
    using value_type = DTypeMap::value_type;
    using reference = std::conditional_t<Const, const value_type&, value_type&>;
    using pointer = std::conditional_t<Const, const value_type*, value_type*>;
    using difference_type = std::ptrdiff_t;
    using iterator_category = std::forward_iterator_tag;
    Iter() = default;
    Iter(Map* m, std::size_t i) : m_(m), i_(i) { skip(); }
    operator Iter<true>() const { return Iter<true>(m_, i_); }
    reference operator*() const { return m_->slots_[i_]; }
    pointer operator->() const { return &m_->slots_[i_]; }
    Iter& operator++() {
      ++i_;
      skip();
      return *this;
    }
    Iter operator++(int) {
      Iter old = *this;
      ++*this;
      return old;
    }
    friend bool operator==(const Iter& a, const Iter& b) { return a.i_ == b.i_; }

   private:
    void skip() {
      while (i_ < kNumDTypes && !m_->has_[i_]) ++i_;
    }
    Map* m_ = nullptr;
    std::size_t i_ = kNumDTypes;
  };
  using iterator = Iter<false>;
  using const_iterator = Iter<true>;

  DTypeMap() { clear(); }
  DTypeMap(std::initializer_list<value_type> values) {
    clear();
    for (const auto& [d, v] : values)
      if (!has_[index(d)]) (*this)[d] = v;  // the first of a repeated format, as std::map keeps
  }

  iterator begin() { return {this, 0}; }
  iterator end() { return {this, kNumDTypes}; }
  const_iterator begin() const { return {this, 0}; }
  const_iterator end() const { return {this, kNumDTypes}; }
  iterator find(DType d) { return has_[index(d)] ? iterator(this, index(d)) : end(); }
  const_iterator find(DType d) const { return has_[index(d)] ? const_iterator(this, index(d)) : end(); }
  bool contains(DType d) const { return has_[index(d)]; }
  std::size_t count(DType d) const { return has_[index(d)] ? 1 : 0; }
  std::size_t size() const {
    std::size_t n = 0;
    for (bool h : has_) n += h ? 1 : 0;
    return n;
  }
  bool empty() const { return size() == 0; }
  // The format's value, value-initialised when it was absent.
  T& operator[](DType d) {
    const std::size_t i = index(d);
    if (!has_[i]) {
      has_[i] = true;
      slots_[i].second = T{};
    }
    return slots_[i].second;
  }
  T& at(DType d) { return const_cast<T&>(std::as_const(*this).at(d)); }
  const T& at(DType d) const {
    if (!has_[index(d)]) throw std::out_of_range("DTypeMap::at: format not present");
    return slots_[index(d)].second;
  }
  std::size_t erase(DType d) {
    const std::size_t i = index(d);
    const bool had = has_[i];
    has_[i] = false;
    slots_[i].second = T{};
    return had ? 1 : 0;
  }
  void clear() {
    for (std::size_t i = 0; i < kNumDTypes; ++i) {
      slots_[i] = {kAllDTypes[i], T{}};
      has_[i] = false;
    }
  }

  // Same formats, and equal values for them (as std::map's ==).
  friend bool operator==(const DTypeMap& a, const DTypeMap& b) {
    for (std::size_t i = 0; i < kNumDTypes; ++i) {
      if (a.has_[i] != b.has_[i]) return false;
      if (a.has_[i] && !(a.slots_[i].second == b.slots_[i].second)) return false;
    }
    return true;
  }

 private:
  static std::size_t index(DType d) { return static_cast<std::size_t>(d); }
  std::array<value_type, kNumDTypes> slots_;  // slot i holds kAllDTypes[i]
  std::array<bool, kNumDTypes> has_;
};

std::string_view dtype_name(DType d);
std::optional<DType> parse_dtype(std::string_view name);

// Bytes one element occupies in memory. tf32 is stored as fp32; fp8 tensors are 1 byte.
int dtype_bytes(DType d);

// Finite range and precision, used by the numerics warnings: largest finite value and
// machine epsilon (spacing of numbers just above 1.0).
double dtype_max(DType d);
double dtype_epsilon(DType d);

}  // namespace trainsim

// Shape: up to 8 non-negative dimensions whose product (and byte size) fits in int64.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/base/error.hpp"

TG_BEGIN_NAMESPACE

/// The dimensions of a row-major tensor. Rank 0 is a scalar (one element).
class Shape {
 public:
  static constexpr int max_rank = 8;

  Shape() = default;
  Shape(std::initializer_list<std::int64_t> dims) { assign(std::span(dims.begin(), dims.size())); }
  explicit Shape(std::span<const std::int64_t> dims) { assign(dims); }
  explicit Shape(const std::vector<std::int64_t>& dims) { assign(dims); }

  int rank() const { return rank_; }
  /// Dimension `axis`; negative axes count from the end, as in NumPy.
  std::int64_t operator[](int axis) const { return dims_[normalize_axis(axis, "Shape[]")]; }
  /// Number of elements (1 for a scalar).
  std::int64_t numel() const { return numel_; }
  std::span<const std::int64_t> dims() const { return {dims_.data(), static_cast<std::size_t>(rank_)}; }

  /// Maps `axis` in [-rank, rank) to [0, rank); anything else is an error naming `op`.
  int normalize_axis(int axis, const char* op) const {
    TG_CHECK(axis >= -rank_ && axis < rank_, op, "axis ", axis, " is out of range for shape ", str(),
             " (rank ", rank_, ")");
    return axis < 0 ? axis + rank_ : axis;
  }

  std::string str() const {
    std::string s = "(";
    for (int i = 0; i < rank_; ++i) {
      if (i) s += ", ";
      s += std::to_string(dims_[i]);
    }
    if (rank_ == 1) s += ",";
    return s + ")";
  }

  friend bool operator==(const Shape& a, const Shape& b) {
    if (a.rank_ != b.rank_) return false;
    for (int i = 0; i < a.rank_; ++i)
      if (a.dims_[i] != b.dims_[i]) return false;
    return true;
  }
  friend std::ostream& operator<<(std::ostream& os, const Shape& s) { return os << s.str(); }

 private:
  void assign(std::span<const std::int64_t> dims) {
    TG_CHECK(dims.size() <= static_cast<std::size_t>(max_rank), "Shape", "rank ", dims.size(),
             " exceeds the maximum rank ", max_rank);
    rank_ = static_cast<int>(dims.size());
    // Sizes are bounded so that the byte size of the largest element type (8 bytes) fits in int64.
    constexpr std::int64_t limit = std::numeric_limits<std::int64_t>::max() / 8;
    numel_ = 1;
    for (int i = 0; i < rank_; ++i) {
      dims_[i] = dims[i];
      TG_CHECK(dims[i] >= 0, "Shape", "dimension ", i, " is negative (", dims[i], ") in ", str_of(dims),
               "; sizes must be >= 0");
      TG_CHECK(dims[i] == 0 || numel_ <= limit / dims[i], "Shape", "the number of elements of ",
               str_of(dims), " overflows (more than ", limit, ")");
      numel_ *= dims[i];
    }
  }

  static std::string str_of(std::span<const std::int64_t> dims) {
    std::string s = "(";
    for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
    return s + ")";
  }

  std::array<std::int64_t, max_rank> dims_{};
  int rank_ = 0;
  std::int64_t numel_ = 1;
};

TG_END_NAMESPACE

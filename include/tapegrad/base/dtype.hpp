// Element types a Tensor may hold, with their names and properties.
#pragma once

#include <cstdint>
#include <type_traits>

#include "tapegrad/config.hpp"
#include "tapegrad/base/bf16.hpp"

TG_BEGIN_NAMESPACE

/// Run-time tag of an element type (for printing, checkpoints and errors; dispatch is static).
enum class DType : std::uint8_t { f32, f64, bf16, i32, u32, u8 };

template <class T> struct dtype_traits;  // undefined: not a tensor element type

template <> struct dtype_traits<float> {
  static constexpr DType dtype = DType::f32;
  static constexpr const char* name = "float32";
  static constexpr bool is_floating = true;
};
template <> struct dtype_traits<double> {
  static constexpr DType dtype = DType::f64;
  static constexpr const char* name = "float64";
  static constexpr bool is_floating = true;
};
template <> struct dtype_traits<bf16> {
  static constexpr DType dtype = DType::bf16;
  static constexpr const char* name = "bfloat16";
  static constexpr bool is_floating = true;
};
template <> struct dtype_traits<std::int32_t> {
  static constexpr DType dtype = DType::i32;
  static constexpr const char* name = "int32";
  static constexpr bool is_floating = false;
};
template <> struct dtype_traits<std::uint32_t> {
  static constexpr DType dtype = DType::u32;
  static constexpr const char* name = "uint32";
  static constexpr bool is_floating = false;
};
template <> struct dtype_traits<std::uint8_t> {
  static constexpr DType dtype = DType::u8;
  static constexpr const char* name = "uint8";
  static constexpr bool is_floating = false;
};

/// A type that can be a Tensor element: float, double, tg::bf16, int32, uint32, uint8.
template <class T>
concept Element = requires { dtype_traits<T>::dtype; };

/// A floating-point element type (float, double, bf16).
template <class T>
concept FloatElement = Element<T> && dtype_traits<T>::is_floating;

template <Element T> inline constexpr DType dtype_of = dtype_traits<T>::dtype;
template <Element T> inline constexpr const char* dtype_name = dtype_traits<T>::name;

/// The name of a run-time dtype tag ("float32", ...).
inline const char* name_of(DType d) {
  switch (d) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::bf16: return "bfloat16";
    case DType::i32: return "int32";
    case DType::u32: return "uint32";
    case DType::u8: return "uint8";
  }
  return "unknown";
}

/// The type arithmetic is done in: float for float and bf16 (bf16 is a storage format), double for double,
/// and the type itself for integers.
template <class T> struct compute_type { using type = T; };
template <> struct compute_type<bf16> { using type = float; };
template <class T> using compute_t = typename compute_type<T>::type;

namespace detail {

/// A value converted to element type T (to bf16: rounded to nearest even), on the host and the device.
template <class T, class C>
TG_HD T convert_to(C v) {
  if constexpr (std::is_same_v<T, bf16>) return bf16(static_cast<float>(v));
  else return static_cast<T>(v);
}

/// An element read as type C (bf16 goes through float, exactly).
template <class C, class T>
TG_HD C convert_from(T v) {
  if constexpr (std::is_same_v<T, bf16>) return static_cast<C>(static_cast<float>(v));
  else return static_cast<C>(v);
}

}  // namespace detail

/// Size in bytes of one element of a run-time dtype.
inline int size_of(DType d) {
  switch (d) {
    case DType::f32: case DType::i32: case DType::u32: return 4;
    case DType::f64: return 8;
    case DType::bf16: return 2;
    case DType::u8: return 1;
  }
  return 0;
}

TG_END_NAMESPACE

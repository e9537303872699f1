// The library's one exception type and the check macros that raise it with "[op] message".
#pragma once

#include "tapegrad/config.hpp"

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

TG_BEGIN_NAMESPACE

/// Every error tapegrad reports: a user mistake, bad input, or a failed CUDA / cuBLAS call.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {

template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

template <class... Args>
[[noreturn]] void fail(const char* op, Args&&... args) {
  throw Error(concat("[", op, "] ", std::forward<Args>(args)...));
}

}  // namespace detail
TG_END_NAMESPACE

/// TG_CHECK(cond, "op", message parts...): throws tg::Error("[op] message") when cond is false.
#define TG_CHECK(cond, op, ...)                  \
  do {                                           \
    if (!(cond)) ::tg::detail::fail(op, __VA_ARGS__); \
  } while (0)

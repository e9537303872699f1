// Pytrees: structs of tensors registered once with TG_PYTREE, and containers of them, traversed with
// paths ("enc.layers[0].w"). tree_map, leaves, paths, counts, zeros_like, global_norm, all_close.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/ops/elementwise.hpp"
#include "tapegrad/ops/indexing.hpp"
#include "tapegrad/ops/reduce.hpp"

// ---- TG_PYTREE(Type, fields...) ----
// Type is a struct or a class template (its name alone: TG_PYTREE(Mlp, w1, b1) for template <class D>
// struct Mlp). Expands, in Type's namespace, to a visitor found by argument-dependent lookup.

#define TG_PP_PARENS ()
#define TG_PP_EXPAND(...) TG_PP_EXPAND4(TG_PP_EXPAND4(TG_PP_EXPAND4(TG_PP_EXPAND4(__VA_ARGS__))))
#define TG_PP_EXPAND4(...) TG_PP_EXPAND3(TG_PP_EXPAND3(TG_PP_EXPAND3(TG_PP_EXPAND3(__VA_ARGS__))))
#define TG_PP_EXPAND3(...) TG_PP_EXPAND2(TG_PP_EXPAND2(TG_PP_EXPAND2(TG_PP_EXPAND2(__VA_ARGS__))))
#define TG_PP_EXPAND2(...) TG_PP_EXPAND1(TG_PP_EXPAND1(TG_PP_EXPAND1(TG_PP_EXPAND1(__VA_ARGS__))))
#define TG_PP_EXPAND1(...) __VA_ARGS__
/// TG_PP_FOR_EACH(m, a, b, c) -> m(a) m(b) m(c), for up to 256 arguments.
#define TG_PP_FOR_EACH(macro, ...) __VA_OPT__(TG_PP_EXPAND(TG_PP_FOR_EACH_HELPER(macro, __VA_ARGS__)))
#define TG_PP_FOR_EACH_HELPER(macro, a1, ...) macro(a1) __VA_OPT__(TG_PP_FOR_EACH_AGAIN TG_PP_PARENS(macro, __VA_ARGS__))
#define TG_PP_FOR_EACH_AGAIN() TG_PP_FOR_EACH_HELPER

#define TG_PYTREE_VISIT_FIELD(field) tg_visit(#field, tg_self.field, tg_others.field...);
#define TG_PYTREE_FIELD_TYPE(field) , decltype(std::declval<Tg_Self&>().field)

/// Registers a struct (or class template) as a pytree whose children are the named fields, in order.
#define TG_PYTREE(Type, ...)                                                                              \
  template <class Tg_Visitor, class Tg_Self, class... Tg_Others>                                          \
    requires(::tg::detail::names_type<Type, std::remove_cvref_t<Tg_Self>>())                              \
  void tg_pytree_visit(Tg_Visitor&& tg_visit, Tg_Self&& tg_self, Tg_Others&&... tg_others) {              \
    TG_PP_FOR_EACH(TG_PYTREE_VISIT_FIELD, __VA_ARGS__)                                                    \
  }                                                                                                       \
  template <class Tg_Self>                                                                                \
    requires(::tg::detail::names_type<Type, std::remove_cvref_t<Tg_Self>>())                              \
  auto tg_pytree_field_types(const Tg_Self*)->std::tuple<void* TG_PP_FOR_EACH(TG_PYTREE_FIELD_TYPE, __VA_ARGS__)>;

namespace tg::inline TG_ABI {

/// Any tensor: what tree_leaves returns.
using AnyTensor =
    std::variant<Tensor<float, Cpu>, Tensor<double, Cpu>, Tensor<bf16, Cpu>, Tensor<std::int32_t, Cpu>, Tensor<std::uint32_t, Cpu>,
                 Tensor<std::uint8_t, Cpu>, Tensor<float, Cuda>, Tensor<double, Cuda>, Tensor<bf16, Cuda>,
                 Tensor<std::int32_t, Cuda>, Tensor<std::uint32_t, Cuda>, Tensor<std::uint8_t, Cuda>>;

namespace detail {

template <class U, template <class...> class Tpl> struct is_specialization : std::false_type {};
template <template <class...> class Tpl, class... A> struct is_specialization<Tpl<A...>, Tpl> : std::true_type {};

/// names_type<Type, U>(): U is Type, or U is a specialisation of the class template Type.
template <class T, class U>
constexpr bool names_type() {
  return std::is_same_v<T, U>;
}
template <template <class...> class Tpl, class U>
constexpr bool names_type() {
  return is_specialization<U, Tpl>::value;
}

template <class T> struct is_tensor : std::false_type {};
template <class T, class D> struct is_tensor<Tensor<T, D>> : std::true_type {};
template <class T> struct is_std_array : std::false_type {};
template <class T, std::size_t N> struct is_std_array<std::array<T, N>> : std::true_type {};
template <class T> struct is_std_vector : std::false_type {};
template <class T, class A> struct is_std_vector<std::vector<T, A>> : std::true_type {};
template <class T> struct is_tuple_like : std::false_type {};
template <class... T> struct is_tuple_like<std::tuple<T...>> : std::true_type {};
template <class A, class B> struct is_tuple_like<std::pair<A, B>> : std::true_type {};

struct NullVisitor {
  template <class... X> void operator()(const char*, X&&...) const {}
};

template <class T>
concept Registered = requires(T& t) { tg_pytree_visit(NullVisitor{}, t); };

/// Appends a child's name to a path: "enc" + "w" -> "enc.w"; "[0]" attaches directly.
inline std::string child_path(const std::string& parent, const std::string& child) {
  std::string p;
  p.reserve(parent.size() + child.size() + 1);
  p.append(parent);
  if (!parent.empty() && child.front() != '[') p.push_back('.');
  p.append(child);
  return p;
}

inline std::string index_path(const std::string& parent, std::size_t i) {
  std::string c(1, '[');
  c.append(std::to_string(i)).push_back(']');
  return child_path(parent, c);
}

template <class F, class First, class... Rest>
void visit_leaves(F& f, const std::string& path, First& first, Rest&... rest);

template <std::size_t I, class F, class First, class... Rest>
void visit_tuple_element(F& f, const std::string& path, First& first, Rest&... rest) {
  visit_leaves(f, index_path(path, I), std::get<I>(first), std::get<I>(rest)...);
}

/// Calls f(path, leaf, other_leaves...) for every Tensor leaf of `first` and the same leaves of `rest`.
template <class F, class First, class... Rest>
void visit_leaves(F& f, const std::string& path, First& first, Rest&... rest) {
  using X = std::remove_const_t<First>;
  if constexpr (is_tensor<X>::value || std::is_same_v<X, bool>) {
    // bool leaves exist for masks (a tree of the parameters' field names saying which leaves to touch).
    f(path, first, rest...);
  } else if constexpr (is_std_array<X>::value) {
    for (std::size_t i = 0; i < first.size(); ++i) visit_leaves(f, index_path(path, i), first[i], rest[i]...);
  } else if constexpr (is_std_vector<X>::value) {
    ((rest.size() == first.size() ? void()
                                   : fail("tree", "structures differ at '", path.empty() ? "<root>" : path, "': a list of ",
                                          first.size(), " vs one of ", rest.size(), " elements")),
     ...);
    for (std::size_t i = 0; i < first.size(); ++i) visit_leaves(f, index_path(path, i), first[i], rest[i]...);
  } else if constexpr (is_tuple_like<X>::value) {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (visit_tuple_element<I>(f, path, first, rest...), ...);
    }(std::make_index_sequence<std::tuple_size_v<X>>{});
  } else if constexpr (Registered<X>) {
    tg_pytree_visit([&](const char* name, auto& child, auto&... others) { visit_leaves(f, child_path(path, name), child, others...); },
                    first, rest...);
  } else {
    static_assert(always_false<X>, "tapegrad: this type is not a pytree; register it with TG_PYTREE(Type, fields...) "
                                   "(children may be Tensors, registered structs, std::array, std::vector, std::tuple/pair)");
  }
}

// ---- the device of a tree's leaves, as a type ----

template <class T> struct leaf_device { using type = void; };
template <class T, class D> struct leaf_device<Tensor<T, D>> { using type = D; };
template <class T, std::size_t N> struct leaf_device<std::array<T, N>> : leaf_device<T> {};
template <class T, class A> struct leaf_device<std::vector<T, A>> : leaf_device<T> {};

template <class... T> struct first_device { using type = void; };
template <class T, class... Rest> struct first_device<T, Rest...> {
  using head = typename leaf_device<std::remove_cvref_t<T>>::type;
  using type = std::conditional_t<std::is_void_v<head>, typename first_device<Rest...>::type, head>;
};
template <class... T> struct leaf_device<std::tuple<T...>> : first_device<T...> {};
template <class A, class B> struct leaf_device<std::pair<A, B>> : first_device<A, B> {};
template <class T> requires Registered<T>
struct leaf_device<T> {
  template <class... F> static auto pick(std::tuple<void*, F...>*) -> typename first_device<F...>::type;
  using type = decltype(pick(static_cast<decltype(tg_pytree_field_types(static_cast<const T*>(nullptr)))*>(nullptr)));
};

}  // namespace detail

/// The device of a pytree's tensors (tg::Cpu when it has none).
template <class Tree>
using tree_device_t = std::conditional_t<std::is_void_v<typename detail::leaf_device<Tree>::type>, Cpu,
                                         typename detail::leaf_device<Tree>::type>;

/// Calls f(path, leaf, leaves of rest...) for every leaf, in order; the trees must share a structure.
template <class F, class Tree, class... Rest>
void tree_for_each(F&& f, Tree& tree, Rest&... rest) {
  detail::visit_leaves(f, std::string(), tree, rest...);
}

/// Calls f(index, path, leaf, leaves of rest...) for every tensor leaf, in order, with index counting the
/// tensor leaves from 0; the bool leaves of masks are skipped. A tuple of trees is a tree: its leaves are
/// numbered across the elements.
template <class F, class Tree, class... Rest>
void tree_for_each_tensor(F&& f, Tree& tree, Rest&... rest) {
  std::size_t index = 0;
  tree_for_each([&](const std::string& path, auto& leaf, auto&... others) {
    if constexpr (!std::is_same_v<std::remove_cvref_t<decltype(leaf)>, bool>) f(index++, path, leaf, others...);
  }, tree, rest...);
}

/// A tree like `tree` whose leaves are f(leaf, leaves of rest...), as jax.tree.map. The trees must share
/// a structure (a mismatch is an error naming the path); f must return each leaf's own tensor type.
template <class F, class Tree, class... Rest>
Tree tree_map(F&& f, const Tree& tree, const Rest&... rest) {
  Tree out = tree;
  tree_for_each([&](const std::string&, auto& leaf, const auto&... others) { leaf = f(others...); }, out, tree, rest...);
  return out;
}

/// Every leaf, in order, as AnyTensor (shared storage, not copies).
template <class Tree>
std::vector<AnyTensor> tree_leaves(const Tree& tree) {
  std::vector<AnyTensor> leaves;
  tree_for_each([&](const std::string&, const auto& leaf) { leaves.emplace_back(leaf); }, tree);
  return leaves;
}

/// The path of every leaf, in order: "w1", "enc.layers[0].w", "[1]".
template <class Tree>
std::vector<std::string> tree_paths(const Tree& tree) {
  std::vector<std::string> paths;
  tree_for_each([&](const std::string& path, const auto&) { paths.push_back(path); }, tree);
  return paths;
}

/// Total number of scalars in the leaves.
template <class Tree>
std::int64_t tree_count(const Tree& tree) {
  std::int64_t n = 0;
  tree_for_each([&](const std::string&, const auto& leaf) { n += leaf.size(); }, tree);
  return n;
}

/// A tree of zeros with the leaves' shapes, dtypes and devices.
template <class Tree>
Tree tree_zeros_like(const Tree& tree) {
  return tree_map([](const auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    return zeros<typename L::value_type, typename L::device_type>(leaf.shape());
  }, tree);
}

namespace detail {

/// Sums of squares of fixed chunks of up to `max_arrays` float arrays in one launch: item i is chunk i of
/// the arrays taken in order (a chunk never straddles two arrays), its sum written to partial[i]. A whole
/// tree's squares in one kernel, each chunk summed in index order, so the result is reproducible.
struct SquareChunksFn {
  static constexpr int max_arrays = 64;
  static constexpr std::int64_t chunk = 256;
  const float* data[max_arrays] = {};
  std::int64_t size[max_arrays] = {};
  std::int64_t first[max_arrays + 1] = {};  ///< the first chunk of each array; first[count] = all chunks
  int count = 0;
  float* partial = nullptr;
  TG_HD void operator()(std::int64_t i) const {
    int a = 0;
    while (a + 1 < count && first[a + 1] <= i) ++a;
    const std::int64_t begin = (i - first[a]) * chunk, end = begin + chunk < size[a] ? begin + chunk : size[a];
    float s = 0.0f;
    for (std::int64_t k = begin; k < end; ++k) s += data[a][k] * data[a][k];
    partial[i] = s;
  }
};

}  // namespace detail

/// sqrt of the sum of squares of every floating leaf, as a 0-d float tensor on the leaves' device. Computed
/// on the device (no host synchronisation), in float (double trees: double rounded to float at the end).
/// The float leaves take one kernel per 64 leaves (sums of squares of 256-element chunks) and one sum of
/// the chunks' results, in order: a few kernels for a whole model instead of several per leaf.
template <class Tree>
Tensor<float, tree_device_t<Tree>> global_norm(const Tree& tree) {
  using D = tree_device_t<Tree>;
  Tensor<double, D> total64;
  Tensor<float, D> total = zeros<float, D>(Shape{});
  std::vector<Tensor<float, D>> floats, partials;
  auto flush = [&] {
    if (floats.empty()) return;
    detail::SquareChunksFn f;
    for (const auto& leaf : floats) {
      f.data[f.count] = leaf.data(), f.size[f.count] = leaf.size();
      f.first[f.count + 1] = f.first[f.count] + (leaf.size() + f.chunk - 1) / f.chunk;
      ++f.count;
    }
    Tensor<float, D> partial(Shape{f.first[f.count]});
    f.partial = partial.data();
    if (partial.size() > 0) detail::index_map<D>(partial.size(), f, f.chunk);
    partials.push_back(partial);
    floats.clear();
  };
  tree_for_each([&](const std::string&, const auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    using T = typename L::value_type;
    if constexpr (std::is_same_v<T, double>) {
      const auto s = sum(square(leaf));
      total64 = total64.defined() ? add(total64, s) : s;
    } else if constexpr (std::is_same_v<T, float>) {
      floats.push_back(leaf.untraced());
      if (floats.size() == static_cast<std::size_t>(detail::SquareChunksFn::max_arrays)) flush();
    } else if constexpr (FloatElement<T>) {
      total = add(total, sum(square(cast<float>(leaf))));
    }
  }, tree);
  flush();
  if (partials.size() == 1) total = add(total, sum(partials[0]));
  else if (!partials.empty()) total = add(total, sum(concatenate(std::span<const Tensor<float, D>>(partials))));
  if (total64.defined()) total = add(total, cast<float>(total64));
  return sqrt(total);
}

/// True when the trees have the same structure and shapes and every pair of elements satisfies
/// |a - b| <= atol + rtol |b| (copies to the host: for tests). `why` receives the first difference.
template <class Tree>
bool tree_all_close(const Tree& a, const Tree& b, double rtol = 1e-5, double atol = 1e-8, std::string* why = nullptr) {
  bool ok = true;
  tree_for_each([&](const std::string& path, const auto& x, const auto& y) {
    if (!ok) return;
    if (!(x.shape() == y.shape())) {
      ok = false;
      if (why) *why = detail::concat(path, ": shapes ", x.shape().str(), " vs ", y.shape().str());
      return;
    }
    const auto xv = x.to_vector(), yv = y.to_vector();
    // Every element type converts exactly to double (bf16 through float).
    auto as_double = [](auto v) {
      if constexpr (std::is_same_v<decltype(v), bf16>) return static_cast<double>(static_cast<float>(v));
      else return static_cast<double>(v);
    };
    for (std::size_t i = 0; i < xv.size(); ++i) {
      const double pd = as_double(xv[i]), qd = as_double(yv[i]);
      if (!(std::fabs(pd - qd) <= atol + rtol * std::fabs(qd))) {
        ok = false;
        if (why) *why = detail::concat(path, "[", i, "]: ", pd, " vs ", qd);
        return;
      }
    }
  }, a, b);
  return ok;
}

}  // namespace tg

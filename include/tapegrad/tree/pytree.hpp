// Pytrees: structs of tensors registered once with TG_PYTREE, and containers of them, traversed with
// paths ("enc.layers[0].w"): tree_map, tree_cast (a map that changes the leaves' dtype, and so the tree's
// type), leaves, paths, counts, zeros_like, all_close. Structure only: what computes over a whole tree
// (global_norm) is in tree/global_norm.hpp.
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

TG_BEGIN_NAMESPACE

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

// ---- the floating type of a tree's leaves, as a type: JAX's promotion of their sum ----

template <class A, class B>
using promote_float = std::conditional_t<std::is_void_v<A>, B,
                      std::conditional_t<std::is_void_v<B>, A,
                      std::conditional_t<std::is_same_v<A, double> || std::is_same_v<B, double>, double,
                      std::conditional_t<std::is_same_v<A, float> || std::is_same_v<B, float>, float, A>>>>;

template <class T> struct leaf_float { using type = void; };
template <class T, class D> struct leaf_float<Tensor<T, D>> { using type = std::conditional_t<FloatElement<T>, T, void>; };
template <class T, std::size_t N> struct leaf_float<std::array<T, N>> : leaf_float<T> {};
template <class T, class A> struct leaf_float<std::vector<T, A>> : leaf_float<T> {};

template <class... T> struct promoted_float { using type = void; };
template <class T, class... Rest> struct promoted_float<T, Rest...> {
  using type = promote_float<typename leaf_float<std::remove_cvref_t<T>>::type, typename promoted_float<Rest...>::type>;
};
template <class... T> struct leaf_float<std::tuple<T...>> : promoted_float<T...> {};
template <class A, class B> struct leaf_float<std::pair<A, B>> : promoted_float<A, B> {};
template <class T> requires Registered<T>
struct leaf_float<T> {
  template <class... F> static auto pick(std::tuple<void*, F...>*) -> typename promoted_float<F...>::type;
  using type = decltype(pick(static_cast<decltype(tg_pytree_field_types(static_cast<const T*>(nullptr)))*>(nullptr)));
};

}  // namespace detail

/// The device of a pytree's tensors (tg::Cpu when it has none).
template <class Tree>
using tree_device_t = std::conditional_t<std::is_void_v<typename detail::leaf_device<Tree>::type>, Cpu,
                                         typename detail::leaf_device<Tree>::type>;

/// The floating type a sum over a pytree's floating leaves has in JAX: double if any leaf is double, else
/// float if any is float, else bf16 (float when the tree has no floating leaf).
template <class Tree>
using tree_float_t = std::conditional_t<std::is_void_v<typename detail::leaf_float<Tree>::type>, float,
                                        typename detail::leaf_float<Tree>::type>;

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

/// The tg::vmap levels any tensor leaf of the trees is batched at (0 outside vmap): what the batching
/// rules of tree-wide operations (global_norm, the optimizers) test.
template <class... Trees>
std::uint32_t tree_batch_levels(const Trees&... trees) {
  std::uint32_t levels = 0;
  auto note = [&](std::size_t, const std::string&, const auto& leaf) { levels |= leaf.batch_levels(); };
  (tree_for_each_tensor(note, trees), ...);
  return levels;
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

template <class X, class U> struct rebind;

/// A template argument of a registered tree with its floating element type replaced by U: a floating
/// element type becomes U, a tree is rebound, anything else (a device, an integer type) stays.
template <class A, class U>
struct rebind_arg {
  using type = A;
};
template <class A, class U>
  requires FloatElement<A>
struct rebind_arg<A, U> {
  using type = U;
};
template <class A, class U>
  requires(!FloatElement<A> && requires { typename rebind<A, U>::type; })
struct rebind_arg<A, U> {
  using type = typename rebind<A, U>::type;
};

template <class T, class D, class U>
struct rebind<Tensor<T, D>, U> {
  using type = std::conditional_t<FloatElement<T>, Tensor<U, D>, Tensor<T, D>>;
};
template <class U>
struct rebind<bool, U> {
  using type = bool;
};
template <class X, std::size_t N, class U>
struct rebind<std::array<X, N>, U> {
  using type = std::array<typename rebind<X, U>::type, N>;
};
template <class X, class U>
struct rebind<std::vector<X>, U> {
  using type = std::vector<typename rebind<X, U>::type>;
};
template <class... X, class U>
struct rebind<std::tuple<X...>, U> {
  using type = std::tuple<typename rebind<X, U>::type...>;
};
template <class A, class B, class U>
struct rebind<std::pair<A, B>, U> {
  using type = std::pair<typename rebind<A, U>::type, typename rebind<B, U>::type>;
};
template <template <class...> class Tpl, class... A, class U>
  requires Registered<Tpl<A...>>
struct rebind<Tpl<A...>, U> {
  using type = Tpl<typename rebind_arg<A, U>::type...>;
};

template <class Tree, class U>
concept Rebindable = requires { typename rebind<Tree, U>::type; };

/// `in` with every floating leaf cast to U, as the tree type Out (rebind<In, U>).
template <Element U, class Out, class In>
Out cast_tree(const In& in) {
  if constexpr (is_tensor<In>::value) {
    return cast<typename Out::value_type>(in);  // the rebound tree's leaf type: U, or a type the struct fixes
  } else if constexpr (std::is_same_v<In, bool>) {
    return in;
  } else if constexpr (is_std_array<In>::value) {
    Out out;
    for (std::size_t i = 0; i < in.size(); ++i) out[i] = cast_tree<U, typename Out::value_type>(in[i]);
    return out;
  } else if constexpr (is_std_vector<In>::value) {
    Out out;
    out.reserve(in.size());
    for (const auto& x : in) out.push_back(cast_tree<U, typename Out::value_type>(x));
    return out;
  } else if constexpr (is_tuple_like<In>::value) {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return Out{cast_tree<U, std::tuple_element_t<I, Out>>(std::get<I>(in))...};
    }(std::make_index_sequence<std::tuple_size_v<In>>{});
  } else {
    Out out;
    tg_pytree_visit([](const char*, auto& to, const auto& from) { to = cast_tree<U, std::remove_cvref_t<decltype(to)>>(from); }, out, in);
    return out;
  }
}

}  // namespace detail

/// The type of tree_cast<U>(tree): Tree with its floating leaves of element type U.
template <class Tree, Element U>
using tree_rebind_t = typename detail::rebind<Tree, U>::type;

/// The tree with its floating leaves cast to U, as jax.tree.map(lambda x: x.astype(U), tree): mixed
/// precision's one cast per step, `tg::tree_cast<tg::bf16>(params)`. The result's type is the tree's
/// template with its floating element type argument replaced (Mlp<D, float> -> Mlp<D, bf16>), so a
/// registered struct meant for this is a template on its element type, and each leaf becomes the type the
/// rebound struct declares for it (a field the struct fixes as double stays double; integer and mask
/// leaves are kept); fields TG_PYTREE does not list are default-initialised. Differentiable (each leaf is a
/// tg::cast), and free where a leaf's type does not change (it is shared).
template <Element U, class Tree>
auto tree_cast(const Tree& tree) {
  if constexpr (detail::Rebindable<Tree, U>) {
    return detail::cast_tree<U, tree_rebind_t<Tree, U>>(tree);
  } else {
    static_assert(detail::always_false<Tree>,
                  "tree_cast: this tree's type cannot change its element type: make the registered struct a template whose "
                  "parameters include its element type (template <class D, class T = float> struct Mlp { tg::Tensor<T, D> w; };)");
  }
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

TG_END_NAMESPACE

// einsum of two operands, as jnp.einsum("bhqd,bhkd->bhqk", q, k): the contraction as one GEMM (batched over
// the indices both operands and the output share), its operands read in place where their layout already
// is (batch, rows, contracted) or (batch, contracted, rows) (the GEMM transposes them), else transposed
// first. Differentiable: it is built from transpose, sum, reshape and matmul.
#pragma once

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tapegrad/config.hpp"
#include "tapegrad/ops/indexing.hpp"
#include "tapegrad/ops/matmul.hpp"
#include "tapegrad/ops/reduce.hpp"

TG_BEGIN_NAMESPACE

namespace detail {

/// One parsed operand or output of an einsum: a letter per axis ("..." expanded to letters of its own).
using EinsumAxes = std::string;

struct EinsumSpec {
  EinsumAxes a, b, out;
};

/// Parses "ab,bc->ac" (letters; "..." at most once per term, the same leading axes in both operands:
/// they become axes of their own, named by characters no letter uses, aligned from the right as NumPy's).
inline EinsumSpec parse_einsum(std::string_view spec, int rank_a, int rank_b) {
  const char* op = "einsum";
  const auto arrow = spec.find("->");
  TG_CHECK(arrow != std::string_view::npos, op, "'", spec, "' has no '->'; write the output's indices too, as in \"ij,jk->ik\"");
  const std::string_view inputs = spec.substr(0, arrow), output = spec.substr(arrow + 2);
  const auto comma = inputs.find(',');
  TG_CHECK(comma != std::string_view::npos && inputs.find(',', comma + 1) == std::string_view::npos, op, "'", spec,
           "' must have exactly two operands (\"ij,jk->ik\")");
  const std::string_view terms[3] = {inputs.substr(0, comma), inputs.substr(comma + 1), output};
  // The ellipsis: as many axes as the operand's rank leaves, the output's as many as the larger.
  auto letters = [&](std::string_view term) {
    std::string s(term);
    if (const auto dots = s.find("..."); dots != std::string::npos) s.erase(dots, 3);
    for (char c : s)
      TG_CHECK((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'), op, "'", spec, "': '", c,
               "' is not an index (indices are letters; '...' may appear once per term)");
    return s;
  };
  const std::string la = letters(terms[0]), lb = letters(terms[1]), lo = letters(terms[2]);
  const bool ea = terms[0].find("...") != std::string_view::npos, eb = terms[1].find("...") != std::string_view::npos;
  const bool eo = terms[2].find("...") != std::string_view::npos;
  const int na = ea ? rank_a - static_cast<int>(la.size()) : 0, nb = eb ? rank_b - static_cast<int>(lb.size()) : 0;
  TG_CHECK(static_cast<int>(la.size()) + na == rank_a && na >= 0, op, "'", spec, "': the first operand has rank ", rank_a, " but ",
           la.size(), " indices");
  TG_CHECK(static_cast<int>(lb.size()) + nb == rank_b && nb >= 0, op, "'", spec, "': the second operand has rank ", rank_b, " but ",
           lb.size(), " indices");
  TG_CHECK(eo || (na == 0 && nb == 0), op, "'", spec, "': the operands' '...' axes must appear in the output ('...' there too)");
  const int ne = std::max(na, nb);
  // The ellipsis axes' names: characters that are not letters, one per axis counted from the right.
  auto ellipsis = [](int count) {
    std::string s;
    for (int i = count; i > 0; --i) s.push_back(static_cast<char>('0' + i - 1));
    return s;
  };
  auto expand = [&](std::string_view term, const std::string& plain, int count) {
    const auto dots = term.find("...");
    if (dots == std::string_view::npos) return plain;
    std::string s(term.substr(0, dots));
    return s + ellipsis(count) + std::string(term.substr(dots + 3));
  };
  EinsumSpec r{expand(terms[0], la, na), expand(terms[1], lb, nb), expand(terms[2], lo, ne)};
  for (const std::string* t : {&r.a, &r.b, &r.out})
    for (std::size_t i = 0; i < t->size(); ++i)
      TG_CHECK(t->find((*t)[i], i + 1) == std::string::npos, op, "'", spec, "': index '", (*t)[i],
               "' appears twice in one term (traces and diagonals are not supported)");
  for (char c : r.out)
    TG_CHECK(r.a.find(c) != std::string::npos || r.b.find(c) != std::string::npos, op, "'", spec, "': the output's index '", c,
             "' is in neither operand");
  return r;
}

/// The axes of `from` in the order of `order` (all of from's axes named there).
inline std::vector<int> axes_in_order(const EinsumAxes& from, const EinsumAxes& order) {
  std::vector<int> perm;
  for (char c : order) perm.push_back(static_cast<int>(from.find(c)));
  return perm;
}

inline bool is_identity(const std::vector<int>& perm) {
  for (std::size_t i = 0; i < perm.size(); ++i)
    if (perm[i] != static_cast<int>(i)) return false;
  return true;
}

/// `x` with the axes named in `axes` that `keep` does not name summed away.
template <class T, class D>
Tensor<T, D> sum_unused(Tensor<T, D> x, EinsumAxes& axes, const EinsumAxes& keep) {
  for (int d = static_cast<int>(axes.size()) - 1; d >= 0; --d) {
    if (keep.find(axes[static_cast<std::size_t>(d)]) != std::string::npos) continue;
    x = sum(x, d);
    axes.erase(static_cast<std::size_t>(d), 1);
  }
  return x;
}

}  // namespace detail

/// Two-operand Einstein summation, as jnp.einsum: indices are letters, "..." stands for leading axes the
/// operands share (their sizes must agree). Indices in both operands and the output are batch axes, in
/// both operands only are contracted, in one operand and the output are its rows or columns, in one operand
/// only are summed first. Runs as one GEMM (a strided batch over the batch axes): "bhqd,bhkd->bhqk" reads
/// k transposed in place, as matmul(q, k, false, true) would.
template <FloatElement T, Device D>
Tensor<T, D> einsum(std::string_view spec, const Tensor<T, D>& a, const Tensor<T, D>& b) {
  detail::check_defined(a, "einsum");
  detail::check_defined(b, "einsum");
  if (detail::batched(a, b)) {  // batching rule: an index of its own per batch axis, in the output too
    const std::uint32_t lv = detail::levels_of(a, b);
    const int nb = detail::batch_rank(lv);
    std::string extra;
    for (char c = 'A'; c <= 'z' && static_cast<int>(extra.size()) < nb; ++c)
      if (std::isalpha(static_cast<unsigned char>(c)) && spec.find(c) == std::string_view::npos) extra.push_back(c);
    TG_CHECK(static_cast<int>(extra.size()) == nb, "einsum", "'", spec, "' leaves no free letters to name vmap's ", nb, " batch axes");
    const auto arrow = spec.find("->"), comma = spec.find(',');
    TG_CHECK(arrow != std::string_view::npos && comma != std::string_view::npos && comma < arrow, "einsum", "'", spec,
             "' must read \"ij,jk->ik\" (two operands and an output)");
    const std::string ta(spec.substr(0, comma)), tb(spec.substr(comma + 1, arrow - comma - 1)), to(spec.substr(arrow + 2));
    const std::string batched_spec = (detail::batched(a) ? extra : "") + ta + "," + (detail::batched(b) ? extra : "") + tb + "->" + extra + to;
    const Tensor<T, D> pa = detail::batched(a) ? detail::materialize(a, lv).physical() : a;
    const Tensor<T, D> pb = detail::batched(b) ? detail::materialize(b, lv).physical() : b;
    return detail::as_batched(einsum(batched_spec, pa, pb), lv);
  }
  detail::EinsumSpec s = detail::parse_einsum(spec, a.rank(), b.rank());
  // Indices of one operand that are nowhere else are summed first.
  const Tensor<T, D> x = detail::sum_unused(a, s.a, s.b + s.out), y = detail::sum_unused(b, s.b, s.a + s.out);
  auto size_of = [&](char c) {
    const auto ia = s.a.find(c), ib = s.b.find(c);
    const std::int64_t na = ia != std::string::npos ? x.dim(static_cast<int>(ia)) : -1;
    const std::int64_t nb = ib != std::string::npos ? y.dim(static_cast<int>(ib)) : -1;
    TG_CHECK(na < 0 || nb < 0 || na == nb, "einsum", "'", spec, "': index '", c, "' has size ", na, " in ", x.shape().str(), " but ", nb,
             " in ", y.shape().str());
    return na >= 0 ? na : nb;
  };
  detail::EinsumAxes batch, rows, cols, contracted;
  for (char c : s.a) {
    const bool in_b = s.b.find(c) != std::string::npos, in_out = s.out.find(c) != std::string::npos;
    if (in_b && in_out) batch += c;
    else if (in_b) contracted += c;
    else rows += c;
  }
  for (char c : s.b)
    if (s.a.find(c) == std::string::npos) cols += c;
  std::int64_t nbatch = 1, m = 1, n = 1, k = 1;
  for (char c : batch) nbatch *= size_of(c);
  for (char c : rows) m *= size_of(c);
  for (char c : cols) n *= size_of(c);
  for (char c : contracted) k *= size_of(c);
  // Each operand as (batch, rows, contracted) or, read transposed by the GEMM, (batch, contracted, rows);
  // in another layout it is transposed first.
  auto operand = [&](Tensor<T, D> t, const detail::EinsumAxes& axes, const detail::EinsumAxes& free, std::int64_t nfree, bool& trans) {
    const auto straight = detail::axes_in_order(axes, batch + free + contracted);
    const auto flipped = detail::axes_in_order(axes, batch + contracted + free);
    trans = !detail::is_identity(straight) && detail::is_identity(flipped);
    if (!trans && !detail::is_identity(straight)) t = transpose(t, straight);
    const std::int64_t r = trans ? k : nfree, c = trans ? nfree : k;
    return batch.empty() ? t.reshape(Shape{r, c}) : t.reshape(Shape{nbatch, r, c});
  };
  bool ta = false, tb = false;
  const Tensor<T, D> a3 = operand(x, s.a, rows, m, ta);
  // b as (batch, contracted, cols) is the GEMM's straight layout, so its "free-first" layout is the flipped one.
  bool tb_flip = false;
  const Tensor<T, D> b3 = operand(y, s.b, cols, n, tb_flip);
  tb = !tb_flip;
  Tensor<T, D> c = matmul(a3, b3, ta, tb);
  // (batch, rows, cols) -> the output's order.
  std::vector<std::int64_t> dims;
  detail::EinsumAxes have = batch + rows + cols;
  for (char ch : have) dims.push_back(size_of(ch));
  c = c.reshape(Shape(dims));
  const auto perm = detail::axes_in_order(have, s.out);
  return detail::is_identity(perm) ? c : transpose(c, perm);
}

TG_END_NAMESPACE

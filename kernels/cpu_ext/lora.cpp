// Batched LoRA deltas added to a linear's outputs, for the CPU (Punica's BGMV shape; runtime/lora.py calls it after
// a targeted linear node, step.cpp after a targeted linear of a fused run: the same function, so both paths give the
// same bits). Row t of the step runs under adapter slot slots[t] (-1: none) and gets
//     out[t] += B[s] (A[s] x[t])      (float32 products and sums of float32 or bfloat16 factors; the sum rounded
//                                       once to out's dtype)
// where the linear's output may be split (a fused qkv / gate_up): part p covers rows [off_p, off_p + n_p) of B and
// reads rank columns [col, col + rank) of slot s's A, as parts (S, P, 2) records per slot (rank 0: the adapter does
// not target that projection). optc/core/ops/lora.py's lora_delta_ref is the specification; the sums here run in
// another order (8-lane partial sums), so results differ from it by float32 rounding (tests/test_lora.py bounds it).
//
// Why not ATen: a decode step's few rows spread over several adapters; two small matmuls, a gather and a scatter per
// adapter and linear cost more in dispatch than in arithmetic, and every slot's factors at once (masked) is S-fold
// work and traffic. Here each slot's A and B are read once for its rows, only the rank columns an adapter uses (a
// fused linear's padded columns are skipped): the shrink runs ROW_BLOCK rows against one row of A at a time, the
// expand walks B transposed (bt, (S, R, N)) so that each output feature sums its rank terms in one vector lane,
// with no horizontal sums. A slot with more than GEMM_ROWS rows (a prefill) runs its two products as ATen GEMMs.
// Built with -ffp-contract=off, as the whole extension is (kernels/cpu_ext/__init__.py's FLAGS).
#include <ATen/ATen.h>

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <vector>

#include "cpu_ext.h"
#include "lora.h"

namespace optc::lora {

constexpr int64_t GEMM_ROWS = 32;  // a slot's rows above which its products run as ATen matmuls
constexpr int ROW_BLOCK = 4;  // rows of x whose products with one row of A run together (one load of A serves them)
constexpr int64_t CHUNK = 64;  // output features per task of the expand: 8 vectors of 8

// h[rows[i] * ldh] = a_row . x[rows[i]] (float32, K = k) for M rows: per row two 8-lane partial sums over
// alternate blocks of 8 in K order (independent chains, so that M rows keep 2 M adds in flight), their lanes added
// in a fixed order, then the tail; a row's sum does not depend on the rows beside it
template <int M, typename W>
void shrink_block(const W* a_row, const float* xf, int64_t k, const int64_t* rows, float* h, int64_t ldh) {
  __m256 acc[M][2];
  for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  int64_t q = 0;
  for (; q + 16 <= k; q += 16) {
    const __m256 a0 = load8(a_row + q), a1 = load8(a_row + q + 8);
    for (int i = 0; i < M; ++i) {
      const float* x = xf + rows[i] * k + q;
      acc[i][0] = _mm256_add_ps(acc[i][0], _mm256_mul_ps(a0, _mm256_loadu_ps(x)));
      acc[i][1] = _mm256_add_ps(acc[i][1], _mm256_mul_ps(a1, _mm256_loadu_ps(x + 8)));
    }
  }
  const bool eight = q + 8 <= k;
  const __m256 a0 = eight ? load8(a_row + q) : _mm256_setzero_ps();
  for (int i = 0; i < M; ++i) {
    if (eight) acc[i][0] = _mm256_add_ps(acc[i][0], _mm256_mul_ps(a0, _mm256_loadu_ps(xf + rows[i] * k + q)));
    float sum = hsum(_mm256_add_ps(acc[i][0], acc[i][1]));
    for (int64_t t = q + (eight ? 8 : 0); t < k; ++t) sum += static_cast<float>(a_row[t]) * xf[rows[i] * k + t];
    h[rows[i] * ldh] = sum;
  }
}

template <typename W>
void shrink(const W* a_row, const float* xf, int64_t k, const std::vector<int64_t>& rows, float* h, int64_t ldh) {
  const int64_t m = static_cast<int64_t>(rows.size());
  for (int64_t i = 0; i < m; i += ROW_BLOCK) {
    const int64_t* r = rows.data() + i;
    switch (std::min<int64_t>(ROW_BLOCK, m - i)) {
      case 4: shrink_block<4>(a_row, xf, k, r, h, ldh); break;
      case 3: shrink_block<3>(a_row, xf, k, r, h, ldh); break;
      case 2: shrink_block<2>(a_row, xf, k, r, h, ldh); break;
      default: shrink_block<1>(a_row, xf, k, r, h, ldh);
    }
  }
}

// out[0, count) += sum over j < rank of h_row[j] * bt[j * ldb + (0, count)], each feature's sum in j order from
// zero, then added to its output and rounded once; VECS 8-lane vectors (count = 8 * VECS), or any count for VECS 0
template <typename T, int VECS, typename W>
void expand_row(const float* h_row, const W* bt, int64_t ldb, int64_t rank, int64_t count, T* out) {
  alignas(32) float d[CHUNK];
  if constexpr (VECS > 0) {
    __m256 acc[VECS];
    for (int v = 0; v < VECS; ++v) acc[v] = _mm256_setzero_ps();
    for (int64_t j = 0; j < rank; ++j) {
      const __m256 hb = _mm256_set1_ps(h_row[j]);
      const W* b = bt + j * ldb;
      for (int v = 0; v < VECS; ++v) acc[v] = _mm256_add_ps(acc[v], _mm256_mul_ps(hb, load8(b + 8 * v)));
    }
    for (int v = 0; v < VECS; ++v) _mm256_store_ps(d + 8 * v, acc[v]);
  } else {
    for (int64_t f = 0; f < count; ++f) d[f] = 0.0f;
    for (int64_t j = 0; j < rank; ++j)
      for (int64_t f = 0; f < count; ++f) d[f] += h_row[j] * static_cast<float>(bt[j * ldb + f]);
  }
  for (int64_t f = 0; f < count; ++f) out[f] = static_cast<T>(static_cast<float>(out[f]) + d[f]);
}

template <typename T, typename W>
void add_rows(const std::vector<at::Tensor>& outs, const std::vector<int64_t>& offsets, const float* xf,
              const std::vector<std::vector<int64_t>>& rows_of, const W* a, const W* bt, const int64_t* parts,
              int64_t num_parts, int64_t r_cap, int64_t k, int64_t n_all, int64_t t) {
  const int64_t num_slots = static_cast<int64_t>(rows_of.size());
  auto small = [&](int64_t s) { return !rows_of[s].empty() && static_cast<int64_t>(rows_of[s].size()) <= GEMM_ROWS; };
  auto part = [&](int64_t s, int64_t p) { return parts + (s * num_parts + p) * 2; };  // {first column, rank}
  // shrink: h[row, j] = A[s, j] . x[row] for the columns slot s uses (its parts' [col, col + rank))
  std::vector<float> h(t * r_cap, 0.0f);
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (slot, column)
  for (int64_t s = 0; s < num_slots; ++s) {
    if (!small(s)) continue;
    for (int64_t p = 0; p < num_parts; ++p)
      for (int64_t j = part(s, p)[0]; j < part(s, p)[0] + part(s, p)[1]; ++j) tasks.emplace_back(s, j);
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), GRAIN_LORA_COLUMNS, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const auto [s, j] = tasks[i];
      shrink(a + (s * r_cap + j) * k, xf, k, rows_of[s], h.data() + j, r_cap);
    }
  });
  // expand: out_p[row, f] += sum_j h[row, col + j] * B^T[s, col + j, off_p + f], per (part, slot, CHUNK features)
  std::vector<std::tuple<int64_t, int64_t, int64_t>> chunks;  // (part, slot, first feature)
  for (int64_t p = 0; p < num_parts; ++p)
    for (int64_t s = 0; s < num_slots; ++s)
      if (small(s) && part(s, p)[1] > 0)
        for (int64_t f = 0; f < outs[p].size(1); f += CHUNK) chunks.emplace_back(p, s, f);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), GRAIN_ITEM, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const auto [p, s, f] = chunks[i];
      const int64_t col = part(s, p)[0], rank = part(s, p)[1];
      const int64_t count = std::min(CHUNK, outs[p].size(1) - f), stride = outs[p].stride(0);
      const W* b = bt + (s * r_cap + col) * n_all + offsets[p] + f;
      T* out = outs[p].data_ptr<T>() + f;
      for (int64_t r : rows_of[s]) {
        if (count == CHUNK)
          expand_row<T, CHUNK / 8, W>(h.data() + r * r_cap + col, b, n_all, rank, count, out + r * stride);
        else
          expand_row<T, 0, W>(h.data() + r * r_cap + col, b, n_all, rank, count, out + r * stride);
      }
    }
  });
}

// out_p += the deltas of x's rows, in place (the linear's output parts: outs, each (T, n_p) with unit column
// stride, of x's dtype); x (T, K) bfloat16 / float32; slots (T,) int64; a (S, R, K) and bt (S, R, N) (B
// transposed: a rank column's output features contiguous) float32 contiguous; parts (S, P, 2) int64 {first column,
// rank} per slot and part
void lora_add(const at::Tensor& x, std::vector<at::Tensor> outs, const at::Tensor& slots, const at::Tensor& a,
              const at::Tensor& bt, const at::Tensor& parts) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "lora_add: x must be a (T, K) CPU tensor");
  TORCH_CHECK((a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16) &&
                  bt.scalar_type() == a.scalar_type() && a.is_contiguous() && bt.is_contiguous() && a.dim() == 3 &&
                  bt.dim() == 3,
              "lora_add: a (S, R, K) and bt (S, R, N) must be contiguous, both float32 or both bfloat16");
  TORCH_CHECK(parts.scalar_type() == at::kLong && parts.is_contiguous() && parts.dim() == 3 &&
                  parts.size(0) == a.size(0) && parts.size(1) == static_cast<int64_t>(outs.size()),
              "lora_add: parts must be (S, P, 2) int64 with one part per output");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == x.size(0),
              "lora_add: slots must be (T,) int64");
  const int64_t t = x.size(0), k = x.size(1), num_slots = a.size(0), r_cap = a.size(1), n_all = bt.size(2);
  TORCH_CHECK(a.size(2) == k && bt.size(0) == num_slots && bt.size(1) == r_cap, "lora_add: a, bt and x disagree");
  std::vector<int64_t> offsets;
  int64_t n_sum = 0;
  for (const auto& o : outs) {
    TORCH_CHECK(o.scalar_type() == x.scalar_type() && o.dim() == 2 && o.size(0) == t && o.stride(1) == 1,
                "lora_add: every output must be (T, n) of x's dtype with unit column stride");
    offsets.push_back(n_sum);
    n_sum += o.size(1);
  }
  TORCH_CHECK(n_sum == n_all, "lora_add: the outputs' features must sum to bt's ", n_all);
  const auto sl = slots.contiguous();
  const int64_t* slot_of = sl.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows_of(num_slots);
  for (int64_t r = 0; r < t; ++r) {
    const int64_t s = slot_of[r];
    TORCH_CHECK(s < num_slots, "lora_add: slot ", s, " of row ", r, " is past the ", num_slots, " slots");
    if (s >= 0) rows_of[s].push_back(r);
  }
  const int64_t* pt = parts.data_ptr<int64_t>();
  const int64_t num_parts = parts.size(1);
  // a slot of more rows: its two products as ATen GEMMs over its gathered rows (the sums of another order)
  for (int64_t s = 0; s < num_slots; ++s) {
    if (static_cast<int64_t>(rows_of[s].size()) <= GEMM_ROWS) continue;
    const auto rows = at::tensor(rows_of[s], at::kLong);
    const auto xs = x.index_select(0, rows).to(at::kFloat);
    for (int64_t p = 0; p < num_parts; ++p) {
      const int64_t col = pt[(s * num_parts + p) * 2], rank = pt[(s * num_parts + p) * 2 + 1];
      if (rank == 0) continue;
      const auto hs = at::matmul(xs, a[s].narrow(0, col, rank).t().to(at::kFloat));
      const auto d = at::matmul(hs, bt[s].narrow(0, col, rank).narrow(1, offsets[p], outs[p].size(1)).to(at::kFloat));
      outs[p].index_copy_(0, rows, (outs[p].index_select(0, rows).to(at::kFloat) + d).to(x.scalar_type()));
    }
  }
  std::vector<float> xf(t * k);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "lora_add", [&] {
    const auto xc = x.contiguous();
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    for (int64_t s = 0; s < num_slots; ++s) {
      if (static_cast<int64_t>(rows_of[s].size()) > GEMM_ROWS) continue;
      for (int64_t r : rows_of[s])
        for (int64_t i = 0; i < k; ++i) xf[r * k + i] = static_cast<float>(xp[r * k + i]);
    }
    if (a.scalar_type() == at::kBFloat16)
      add_rows<scalar_t>(outs, offsets, xf.data(), rows_of, a.data_ptr<c10::BFloat16>(), bt.data_ptr<c10::BFloat16>(),
                         pt, num_parts, r_cap, k, n_all, t);
    else
      add_rows<scalar_t>(outs, offsets, xf.data(), rows_of, a.data_ptr<float>(), bt.data_ptr<float>(), pt, num_parts,
                         r_cap, k, n_all, t);
  });
}

}  // namespace optc::lora

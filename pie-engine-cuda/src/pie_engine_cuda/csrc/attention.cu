// Paged attention over FlashInfer-style page tables (see pie.kernels): causal, grouped KV heads,
// an optional sliding window (a query sees its last `window` keys) and logit soft-capping.
// A layer's pool is [pages, 2, page_size, kv_heads * head_dim] float32, keys before values.
// Kernels: decode (a block per token and head), split-KV (a token's keys cut into chunks planned
// on the host, then merged), and prefill (a block per tile of one sequence's new tokens).
// All of them accept any ragged batch; they differ in how they share work.

#define PIE_ATTN_THREADS 128
#define PIE_ATTN_WARPS (PIE_ATTN_THREADS / PIE_WARP)
#define PIE_ATTN_KEYS_AT_ONCE 4  // keys (decode) or elements (prefill) whose loads are issued together
#define PIE_PREFILL_SLOTS 16  // block_q * head_dim <= PIE_ATTN_THREADS * PIE_PREFILL_SLOTS
#define PIE_NEG_BIG (-1.0e30f)  // a finite "minus infinity": exp(PIE_NEG_BIG - m) is 0, never NaN

struct PieSeq {
  int q_begin;
  int q_len;
  int kv_len;
  int page_begin;
};

PIE_DEVICE PieSeq pie_sequence(const AttnArgs& a, int b) {
  PieSeq s;
  s.q_begin = a.qo_indptr[b];
  s.q_len = a.qo_indptr[b + 1] - s.q_begin;
  s.page_begin = a.page_indptr[b];
  s.kv_len = (a.page_indptr[b + 1] - s.page_begin - 1) * a.page_size + a.last_lens[b];
  return s;
}

// The sequence holding token t: the last b with qo_indptr[b] <= t (skips sequences without new tokens).
PIE_DEVICE int pie_sequence_of(const AttnArgs& a, int t) {
  int lo = 0, hi = a.batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a.qo_indptr[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Keys visible to token t: a sequence's new tokens are the last q_len of its kv_len.
PIE_DEVICE int pie_visible(const PieSeq& s, int t) { return s.kv_len - s.q_len + (t - s.q_begin) + 1; }

// The first key a query that sees `visible` keys attends to: its window's first, 0 without a window.
PIE_DEVICE int pie_window_start(const AttnArgs& a, int visible) {
  return a.window > 0 && visible > a.window ? visible - a.window : 0;
}

// A score soft-capped when the launch asks for it.
PIE_DEVICE float pie_capped(const AttnArgs& a, float score) {
  return a.softcap > 0.0f ? a.softcap * tanhf(score / a.softcap) : score;
}

// The pool row of key j of the sequence: its page's first row plus j's place in the page.
PIE_DEVICE int pie_key_row(const AttnArgs& a, const PieSeq& s, int j) {
  return a.page_indices[s.page_begin + j / a.page_size] * 2 * a.page_size + j % a.page_size;
}

// A pool row's keys (or values, page_size rows further) for one KV head.
PIE_DEVICE const float* pie_row(const AttnArgs& a, int row, int kv_head) {
  const long long width = static_cast<long long>(a.kv_heads) * a.head_dim;
  return a.pool + row * width + static_cast<long long>(kv_head) * a.head_dim;
}

// Key j of the sequence for one KV head; its value lies page_size * width floats further.
PIE_DEVICE const float* pie_key(const AttnArgs& a, const PieSeq& s, int j, int kv_head) {
  return pie_row(a, pie_key_row(a, s, j), kv_head);
}

PIE_DEVICE long long pie_value_offset(const AttnArgs& a) {
  return static_cast<long long>(a.page_size) * a.kv_heads * a.head_dim;
}

// The whole block attends query head `head` of token t to keys [k_begin, k_end) (non-empty).
// Each warp takes chunks of PIE_WARP keys, a key per lane for the scores, then a head dimension per
// lane for the values, with an online softmax; the warps' states are merged at the end.
// With `dst_ml` null, dst receives the normalized output; otherwise dst gets the unnormalized sum
// and dst_ml the running max and denominator, for the split-KV merge.
PIE_DEVICE void pie_attend(const AttnArgs& a, const PieSeq& s, int t, int head, int k_begin, int k_end, float* dst,
                           float* dst_ml) {
  __shared__ float q[PIE_MAX_HEAD_DIM];
  __shared__ float part[PIE_ATTN_WARPS][PIE_MAX_HEAD_DIM];
  __shared__ float part_ml[PIE_ATTN_WARPS][2];
  const int d = a.head_dim, lane = threadIdx.x % PIE_WARP, warp = threadIdx.x / PIE_WARP;
  const int kv_head = head / (a.num_heads / a.kv_heads);
  const long long value_offset = pie_value_offset(a);
  for (int e = threadIdx.x; e < d; e += blockDim.x) {
    q[e] = a.q[(static_cast<long long>(t) * a.num_heads + head) * d + e] * a.scale;
  }
  __syncthreads();
  float m = PIE_NEG_BIG, l = 0.0f;
  float acc[PIE_MAX_HEAD_DIM / PIE_WARP];
#pragma unroll
  for (int i = 0; i < PIE_MAX_HEAD_DIM / PIE_WARP; ++i) acc[i] = 0.0f;
  for (int c0 = k_begin + warp * PIE_WARP; c0 < k_end; c0 += PIE_ATTN_WARPS * PIE_WARP) {
    const int j = c0 + lane;
    float score = PIE_NEG_BIG;
    const int key_row = j < k_end ? pie_key_row(a, s, j) : 0;
    if (j < k_end) {
      const float* key = pie_row(a, key_row, kv_head);
      float dot = 0.0f;
      if (d % 4 == 0) {
#pragma unroll 4
        for (int e = 0; e < d; e += 4) {
          const pie_vec4 k4 = *reinterpret_cast<const pie_vec4*>(key + e);
          dot += q[e] * k4.x + q[e + 1] * k4.y + q[e + 2] * k4.z + q[e + 3] * k4.w;
        }
      } else {
        for (int e = 0; e < d; ++e) dot += q[e] * key[e];
      }
      score = pie_capped(a, dot);
    }
    const float m_new = fmaxf(m, pie_warp_max(score));
    const float p = j < k_end ? expf(score - m_new) : 0.0f;
    const float correction = expf(m - m_new);
    l = l * correction + pie_warp_sum(p);
#pragma unroll
    for (int i = 0; i < PIE_MAX_HEAD_DIM / PIE_WARP; ++i) acc[i] *= correction;
    // Values four keys at a time, so that their loads are in flight together; each key's row
    // comes from the lane that scored it.
    const int count = pie_min(PIE_WARP, k_end - c0);
    for (int jj = 0; jj < count; jj += PIE_ATTN_KEYS_AT_ONCE) {
      float values[PIE_ATTN_KEYS_AT_ONCE][PIE_MAX_HEAD_DIM / PIE_WARP];
#pragma unroll
      for (int u = 0; u < PIE_ATTN_KEYS_AT_ONCE; ++u) {
        const int source = pie_min(jj + u, count - 1);
        const float* value = pie_row(a, pie_shfl(key_row, source), kv_head) + value_offset;
#pragma unroll
        for (int i = 0; i < PIE_MAX_HEAD_DIM / PIE_WARP; ++i) {
          const int e = lane + i * PIE_WARP;
          values[u][i] = e < d ? value[e] : 0.0f;
        }
      }
#pragma unroll
      for (int u = 0; u < PIE_ATTN_KEYS_AT_ONCE; ++u) {
        const float pj = pie_shfl(p, jj + u);  // 0 past the last key
#pragma unroll
        for (int i = 0; i < PIE_MAX_HEAD_DIM / PIE_WARP; ++i) acc[i] += pj * values[u][i];
      }
    }
    m = m_new;
  }
#pragma unroll
  for (int i = 0; i < PIE_MAX_HEAD_DIM / PIE_WARP; ++i) {
    const int e = lane + i * PIE_WARP;
    if (e < d) part[warp][e] = acc[i];
  }
  if (lane == 0) {
    part_ml[warp][0] = m;
    part_ml[warp][1] = l;
  }
  __syncthreads();
  float top = part_ml[0][0];
  for (int w = 1; w < PIE_ATTN_WARPS; ++w) top = fmaxf(top, part_ml[w][0]);
  float total = 0.0f;
  for (int w = 0; w < PIE_ATTN_WARPS; ++w) total += part_ml[w][1] * expf(part_ml[w][0] - top);
  for (int e = threadIdx.x; e < d; e += blockDim.x) {
    float v = 0.0f;
    for (int w = 0; w < PIE_ATTN_WARPS; ++w) v += part[w][e] * expf(part_ml[w][0] - top);
    dst[e] = dst_ml == nullptr ? v / total : v;
  }
  if (dst_ml != nullptr && threadIdx.x == 0) {
    dst_ml[0] = top;
    dst_ml[1] = total;
  }
}

// Grid (tokens, num_heads).
PIE_KERNEL(pie_attention_decode, AttnArgs, PIE_ATTN_THREADS) {
  const int t = blockIdx.x, head = blockIdx.y;
  const PieSeq s = pie_sequence(args, pie_sequence_of(args, t));
  float* out = args.out + (static_cast<long long>(t) * args.num_heads + head) * args.head_dim;
  const int visible = pie_visible(s, t);
  pie_attend(args, s, t, head, pie_window_start(args, visible), visible, out, nullptr);
}

// Grid (items, num_heads); item i = (token, first key, end key), within the token's window (planned
// so on the host). Partial states are
// [head_dim sums, max, denominator] per item and head.
PIE_KERNEL(pie_attention_split, AttnArgs, PIE_ATTN_THREADS) {
  const int item = blockIdx.x, head = blockIdx.y;
  const int t = args.items[3 * item], k_begin = args.items[3 * item + 1], k_end = args.items[3 * item + 2];
  const PieSeq s = pie_sequence(args, pie_sequence_of(args, t));
  float* dst = args.partial + (static_cast<long long>(item) * args.num_heads + head) * (args.head_dim + 2);
  pie_attend(args, s, t, head, k_begin, k_end, dst, dst + args.head_dim);
}

// Grid (tokens, num_heads): merges the partial states of token t's items.
PIE_KERNEL(pie_attention_merge, AttnArgs, PIE_ATTN_THREADS) {
  const int t = blockIdx.x, head = blockIdx.y, d = args.head_dim;
  const int first = args.item_ptr[t], last = args.item_ptr[t + 1];
  const long long stride = static_cast<long long>(args.num_heads) * (d + 2);
  const float* partial = args.partial + static_cast<long long>(head) * (d + 2);
  float top = PIE_NEG_BIG;
  for (int i = first; i < last; ++i) top = fmaxf(top, partial[i * stride + d]);
  float total = 0.0f;
  for (int i = first; i < last; ++i) total += partial[i * stride + d + 1] * expf(partial[i * stride + d] - top);
  float* out = args.out + (static_cast<long long>(t) * args.num_heads + head) * d;
  for (int e = threadIdx.x; e < d; e += blockDim.x) {
    float v = 0.0f;
    for (int i = first; i < last; ++i) v += partial[i * stride + e] * expf(partial[i * stride + d] - top);
    out[e] = v / total;
  }
}

// Grid (items, num_heads); item i = (sequence, first token, token count <= block_q). The tile's
// queries share every key and value tile loaded into shared memory (dynamic, sized on the host).
PIE_KERNEL(pie_attention_prefill, AttnArgs, PIE_ATTN_THREADS) {
  PIE_DYNAMIC_SHARED(float, smem);
  const int d = args.head_dim, bq = args.block_q, bk = args.block_k;
  const int item = blockIdx.x, head = blockIdx.y;
  const PieSeq s = pie_sequence(args, args.items[3 * item]);
  const int q0 = args.items[3 * item + 1], qn = args.items[3 * item + 2];
  const int kv_head = head / (args.num_heads / args.kv_heads);
  const long long value_offset = pie_value_offset(args);
  float* qs = smem;                // [bq][d]
  float* ks = qs + bq * d;         // [bk][d + 1]: padded against bank conflicts
  float* vs = ks + bk * (d + 1);   // [bk][d]
  float* ps = vs + bk * d;         // [bq][bk]: scores, then probabilities
  float* row_m = ps + bq * bk;     // [bq]
  float* row_l = row_m + bq;       // [bq]
  float* row_c = row_l + bq;       // [bq]: this tile's correction of the running sums
  const int first_visible = pie_visible(s, q0);
  const int keys = first_visible + qn - 1;  // visible to the tile's last query
  const int first_key = pie_window_start(args, first_visible);  // the first in the tile's first query's window
  for (int i = threadIdx.x; i < bq * d; i += blockDim.x) {
    const int r = i / d, e = i % d;
    qs[i] = r < qn ? args.q[(static_cast<long long>(q0 + r) * args.num_heads + head) * d + e] * args.scale : 0.0f;
  }
  for (int r = threadIdx.x; r < bq; r += blockDim.x) {
    row_m[r] = PIE_NEG_BIG;
    row_l[r] = 0.0f;
  }
  float o[PIE_PREFILL_SLOTS];
#pragma unroll
  for (int i = 0; i < PIE_PREFILL_SLOTS; ++i) o[i] = 0.0f;
  const int lane = threadIdx.x % PIE_WARP, warp = threadIdx.x / PIE_WARP;
  for (int k0 = first_key; k0 < keys; k0 += bk) {
    __syncthreads();
    // PIE_ATTN_KEYS_AT_ONCE elements per thread and round, loaded before any is stored.
    for (int i0 = threadIdx.x; i0 < bk * d; i0 += PIE_ATTN_KEYS_AT_ONCE * PIE_ATTN_THREADS) {
      float key[PIE_ATTN_KEYS_AT_ONCE], value[PIE_ATTN_KEYS_AT_ONCE];
#pragma unroll
      for (int u = 0; u < PIE_ATTN_KEYS_AT_ONCE; ++u) {
        const int i = i0 + u * PIE_ATTN_THREADS, c = i / d, e = i % d, j = k0 + c;
        key[u] = value[u] = 0.0f;
        if (i < bk * d && j < keys) {
          const float* k = pie_key(args, s, j, kv_head);
          key[u] = k[e];
          value[u] = k[value_offset + e];
        }
      }
#pragma unroll
      for (int u = 0; u < PIE_ATTN_KEYS_AT_ONCE; ++u) {
        const int i = i0 + u * PIE_ATTN_THREADS, c = i / d, e = i % d;
        if (i < bk * d) {
          ks[c * (d + 1) + e] = key[u];
          vs[c * d + e] = value[u];
        }
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < bq * bk; i += blockDim.x) {
      const int r = i / bk, c = i % bk;
      float score = pie_neg_inf();
      if (r < qn && k0 + c < first_visible + r && k0 + c >= pie_window_start(args, first_visible + r)) {
        float dot = 0.0f;
        for (int e = 0; e < d; ++e) dot += qs[r * d + e] * ks[c * (d + 1) + e];
        score = pie_capped(args, dot);
      }
      ps[i] = score;
    }
    __syncthreads();
    for (int r = warp; r < bq; r += PIE_ATTN_WARPS) {
      const float score = lane < bk ? ps[r * bk + lane] : pie_neg_inf();
      const float m_old = row_m[r];
      const float m_new = fmaxf(m_old, pie_warp_max(score));
      const float p = expf(score - m_new);  // masked scores are -inf: p = 0
      const float sum = pie_warp_sum(p);
      if (lane < bk) ps[r * bk + lane] = p;
      if (lane == 0) {
        const float correction = expf(m_old - m_new);
        row_c[r] = correction;
        row_l[r] = row_l[r] * correction + sum;
        row_m[r] = m_new;
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < PIE_PREFILL_SLOTS; ++i) {
      const int idx = threadIdx.x + i * PIE_ATTN_THREADS;
      if (idx < bq * d) {
        const int r = idx / d, e = idx % d;
        float v = o[i] * row_c[r];
        for (int c = 0; c < bk; ++c) v += ps[r * bk + c] * vs[c * d + e];
        o[i] = v;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < PIE_PREFILL_SLOTS; ++i) {
    const int idx = threadIdx.x + i * PIE_ATTN_THREADS;
    if (idx < bq * d) {
      const int r = idx / d, e = idx % d;
      if (r < qn) args.out[(static_cast<long long>(q0 + r) * args.num_heads + head) * d + e] = o[i] / row_l[r];
    }
  }
}

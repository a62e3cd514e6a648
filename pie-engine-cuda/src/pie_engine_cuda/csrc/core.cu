// Elementwise kernels, normalization, rotary embedding, gathers, the KV page pool, argmax, softmax.
// Activations are float32; `n`-sized kernels use a 1-D grid of 256-thread blocks.

PIE_DEVICE long long pie_global_index() {
  return static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
}

PIE_KERNEL(pie_add, BinaryArgs, 256) {
  const long long i = pie_global_index();
  if (i < args.n) args.out[i] = args.a[i] + args.b[i];
}

PIE_KERNEL(pie_silu_mul, SiluMulArgs, 256) {
  const long long i = pie_global_index();
  if (i >= args.n) return;
  const long long row = i / args.half, col = i % args.half;
  const float* x = args.x + row * 2 * args.half;
  args.out[i] = pie_silu(x[col]) * x[args.half + col];
}

PIE_KERNEL(pie_slice_columns, SliceArgs, 256) {
  const long long i = pie_global_index();
  if (i >= args.n) return;
  const long long row = i / args.count, col = i % args.count;
  args.out[i] = args.x[row * args.width + args.start + col];
}

// Rows of a table in any weight type (embedding lookups, gather_rows); an index outside the table gives NaN.
template <typename T>
PIE_DEVICE void pie_gather(const GatherArgs& args) {
  const long long i = pie_global_index();
  if (i >= args.n) return;
  const long long r = i / args.cols, c = i % args.cols;
  const int row = args.rows[r];
  const T* table = static_cast<const T*>(args.table);
  args.out[i] = (row >= 0 && row < args.table_rows) ? pie_load_at(pie_row(table, row, args.cols), static_cast<int>(c))
                                                     : pie_nan();
}

PIE_KERNEL(pie_gather_f32, GatherArgs, 256) { pie_gather<float>(args); }
PIE_KERNEL(pie_gather_f16, GatherArgs, 256) { pie_gather<pie_f16>(args); }
PIE_KERNEL(pie_gather_bf16, GatherArgs, 256) { pie_gather<pie_bf16>(args); }
PIE_KERNEL(pie_gather_q8_0, GatherArgs, 256) { pie_gather<pie_q8_0>(args); }
PIE_KERNEL(pie_gather_q4_0, GatherArgs, 256) { pie_gather<pie_q4_0>(args); }
PIE_KERNEL(pie_gather_q4_1, GatherArgs, 256) { pie_gather<pie_q4_1>(args); }
PIE_KERNEL(pie_gather_q5_0, GatherArgs, 256) { pie_gather<pie_q5_0>(args); }
PIE_KERNEL(pie_gather_q4_k, GatherArgs, 256) { pie_gather<pie_q4_k>(args); }
PIE_KERNEL(pie_gather_q5_k, GatherArgs, 256) { pie_gather<pie_q5_k>(args); }
PIE_KERNEL(pie_gather_q6_k, GatherArgs, 256) { pie_gather<pie_q6_k>(args); }

// Reads a buffer once, 16 bytes a load, grid-stride: the memory-bandwidth probe. The sum only has
// to exist; the sink is written only for a value a zeroed buffer never sums to.
PIE_KERNEL(pie_read_sweep, SweepArgs, 256) {
  const pie_vec4* x = reinterpret_cast<const pie_vec4*>(args.x);
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  float sum = 0.0f;
#pragma unroll 4
  for (long long i = pie_global_index(); i < args.count; i += stride) {
    const pie_vec4 v = x[i];
    sum += (v.x + v.y) + (v.z + v.w);
  }
  if (sum == 12345.0f) args.sink[0] = sum;
}

PIE_KERNEL(pie_convert_f16, ConvertArgs, 256) {
  const long long i = pie_global_index();
  if (i < args.n) static_cast<pie_f16*>(args.dst)[i] = pie_f32_to_f16(args.src[i]);
}

PIE_KERNEL(pie_convert_bf16, ConvertArgs, 256) {
  const long long i = pie_global_index();
  if (i < args.n) static_cast<pie_bf16*>(args.dst)[i] = pie_f32_to_bf16(args.src[i]);
}

// One block per row: out = x / sqrt(mean(x^2) + eps) * weight.
PIE_KERNEL(pie_rms_norm, RmsArgs, 256) {
  __shared__ float scratch[32];
  const int row = blockIdx.x;
  const float* x = args.x + static_cast<long long>(row) * args.cols;
  float squares = 0.0f;
  for (int c = threadIdx.x; c < args.cols; c += blockDim.x) squares += x[c] * x[c];
  squares = pie_block_sum(squares, scratch);
  const float inv = pie_inv_rms(squares, args.cols, args.eps);
  float* out = args.out + static_cast<long long>(row) * args.cols;
  for (int c = threadIdx.x; c < args.cols; c += blockDim.x) out[c] = x[c] * inv * args.weight[c];
}

// Rotate-half of the pair (i, i + half) of one head (src and dst at the head's start). The angle is
// the float32 product position * inv_freq[i], as transformers computes it.
PIE_DEVICE void pie_rotate_pair(const float* src, float* dst, int i, int half, int position, const float* inv_freq) {
  const float angle = static_cast<float>(position) * inv_freq[i];
  float s, c;
  sincosf(angle, &s, &c);
  const float x1 = src[i], x2 = src[i + half];
  dst[i] = x1 * c - x2 * s;
  dst[i + half] = x2 * c + x1 * s;
}

// Rotate-half rotary embedding. Grid (tokens, ceil(heads * head_dim / 2 / 128)): one thread per
// rotated pair.
PIE_KERNEL(pie_rope, RopeArgs, 128) {
  const int t = blockIdx.x;
  const int half = args.head_dim / 2;
  const int pair = blockIdx.y * blockDim.x + threadIdx.x;
  if (pair >= args.heads * half) return;
  const int head = pair / half;
  const long long base = (static_cast<long long>(t) * args.heads + head) * args.head_dim;
  pie_rotate_pair(args.x + base, args.out + base, pair % half, half, args.positions[t], args.inv_freq);
}

// The tail of the attention input in one launch: token t's row of the QKV projection split into
// q, k and v, with q and k rotated as pie_rope does. Grid (tokens, ceil(items / 128)); a token's items
// are its q_width / 2 + kv_width / 2 rotated pairs, then its kv_width values of v.
PIE_KERNEL(pie_qkv_rope, QkvRopeArgs, 128) {
  const int t = blockIdx.x;
  const int half = args.head_dim / 2;
  const int q_pairs = args.q_width / 2, pairs = q_pairs + args.kv_width / 2;
  const int item = blockIdx.y * blockDim.x + threadIdx.x;
  const float* row = args.qkv + static_cast<long long>(t) * (args.q_width + 2 * args.kv_width);
  if (item < pairs) {
    const bool is_q = item < q_pairs;
    const int pair = is_q ? item : item - q_pairs;
    const int head = pair / half;
    const float* src = row + (is_q ? 0 : args.q_width) + head * args.head_dim;
    float* dst = (is_q ? args.q + static_cast<long long>(t) * args.q_width
                       : args.k + static_cast<long long>(t) * args.kv_width) + head * args.head_dim;
    pie_rotate_pair(src, dst, pair % half, half, args.positions[t], args.inv_freq);
  } else if (item < pairs + args.kv_width) {
    const int j = item - pairs;
    args.v[static_cast<long long>(t) * args.kv_width + j] = row[args.q_width + args.kv_width + j];
  }
}

// Grid (tokens, ceil(width / 128)): token t's K and V rows go to flat slot page * page_size + offset.
// A negative slot means "no slot" (padding) and writes nothing.
PIE_KERNEL(pie_append_kv, AppendKvArgs, 128) {
  const int t = blockIdx.x;
  const int j = blockIdx.y * blockDim.x + threadIdx.x;
  const int slot = args.slots[t];
  if (j >= args.width || slot < 0) return;
  const long long page = slot / args.page_size, offset = slot % args.page_size;
  float* key = args.pool + (page * 2 * args.page_size + offset) * args.width;
  const long long source = static_cast<long long>(t) * args.width + j;
  key[j] = args.k[source];
  key[static_cast<long long>(args.page_size) * args.width + j] = args.v[source];
}

// Copies whole pages between the pool and a dense buffer [layers, count, page_elems].
// Grid (ceil(page_elems / 256), pages in this chunk, layers).
PIE_KERNEL(pie_copy_pages, PagesArgs, 256) {
  const long long e = pie_global_index();
  const int i = args.first + blockIdx.y;
  const long long layer = blockIdx.z;
  if (e >= args.page_elems || i >= args.count) return;
  float* pool = args.pool + (layer * args.num_pages + args.page_ids[i]) * args.page_elems + e;
  float* buffer = args.buffer + (layer * args.count + i) * args.page_elems + e;
  if (args.to_pool) {
    *pool = *buffer;
  } else {
    *buffer = *pool;
  }
}

// One block per row; ties go to the lowest index, as numpy's argmax.
PIE_KERNEL(pie_argmax, ArgmaxArgs, 256) {
  __shared__ float values[32];
  __shared__ int indices[32];
  const float* x = args.x + static_cast<long long>(blockIdx.x) * args.cols;
  float best = pie_neg_inf();
  int index = -1;
  for (int c = threadIdx.x; c < args.cols; c += blockDim.x) {
    const float v = x[c];
    if (index < 0 || v > best) {
      best = v;
      index = c;
    }
  }
  for (int mask = PIE_WARP / 2; mask > 0; mask >>= 1) {
    const float other = pie_shfl_xor(best, mask);
    const int other_index = pie_shfl_xor(index, mask);
    if (other_index >= 0 && (index < 0 || other > best || (other == best && other_index < index))) {
      best = other;
      index = other_index;
    }
  }
  const int lane = threadIdx.x % PIE_WARP, warp = threadIdx.x / PIE_WARP;
  if (lane == 0) {
    values[warp] = best;
    indices[warp] = index;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x / PIE_WARP); ++w) {
      if (indices[w] >= 0 && (index < 0 || values[w] > best || (values[w] == best && indices[w] < index))) {
        best = values[w];
        index = indices[w];
      }
    }
    args.out[blockIdx.x] = index;
  }
}

// One block per row: softmax(x / temperature).
PIE_KERNEL(pie_softmax, SoftmaxArgs, 256) {
  __shared__ float scratch[32];
  const long long offset = static_cast<long long>(blockIdx.x) * args.cols;
  const float* x = args.x + offset;
  float* out = args.out + offset;
  float top = pie_neg_inf();
  for (int c = threadIdx.x; c < args.cols; c += blockDim.x) top = fmaxf(top, x[c] / args.temperature);
  top = pie_block_max(top, scratch);
  float total = 0.0f;
  for (int c = threadIdx.x; c < args.cols; c += blockDim.x) total += expf(x[c] / args.temperature - top);
  total = pie_block_sum(total, scratch);
  const float inv_total = 1.0f / total;
  for (int c = threadIdx.x; c < args.cols; c += blockDim.x) out[c] = expf(x[c] / args.temperature - top) * inv_total;
}

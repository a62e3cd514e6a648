// Sampling helpers. pie_top_k: each row's k largest values with their indices, best first (ties:
// lower index first, as a stable sort of -x; NaN is skipped), so a top-k / top-p sampler reads k
// candidates instead of the whole vocabulary. One block of 256 threads per row, k <= 256:
//   1. the k-th largest value, found bit by bit on an order-preserving unsigned key;
//   2. the values above it and the lowest-index ties, gathered in index order (block scans);
//   3. a bitonic sort of the k candidates in shared memory.

#define PIE_TOPK_THREADS 256
#define PIE_TOPK_MAX 256

// An unsigned key with the order of the floats (for non-NaN values).
PIE_DEVICE unsigned pie_order_key(float v) {
  const unsigned u = pie_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum of one value per thread, in thread order; `scratch` holds blockDim + 1 ints.
PIE_DEVICE int pie_block_exclusive_scan(int value, int* scratch, int& total) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  if (threadIdx.x == 0) {
    int running = 0;
    for (int i = 0; i < static_cast<int>(blockDim.x); ++i) {
      const int v = scratch[i];
      scratch[i] = running;
      running += v;
    }
    scratch[blockDim.x] = running;
  }
  __syncthreads();
  const int offset = scratch[threadIdx.x];
  total = scratch[blockDim.x];
  __syncthreads();
  return offset;
}

// Whether candidate a belongs before candidate b: larger value, or equal value and lower index.
PIE_DEVICE bool pie_precedes(float av, int ai, float bv, int bi) { return av > bv || (av == bv && ai < bi); }

PIE_KERNEL(pie_top_k, TopKArgs, PIE_TOPK_THREADS) {
  __shared__ float sums[32];
  __shared__ int scan[PIE_TOPK_THREADS + 1];
  __shared__ float best_values[PIE_TOPK_MAX];
  __shared__ int best_indices[PIE_TOPK_MAX];
  const int cols = args.cols, k = args.k;
  const float* x = args.x + static_cast<long long>(blockIdx.x) * cols;
  // Each thread owns a contiguous run of columns, so thread order is index order.
  const int chunk = (cols + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  const int begin = pie_min(cols, static_cast<int>(threadIdx.x) * chunk), end = pie_min(cols, begin + chunk);

  unsigned threshold = 0;  // the largest key with at least k values at or above it
  for (int bit = 31; bit >= 0; --bit) {
    const unsigned candidate = threshold | (1u << bit);
    float count = 0.0f;  // exact: counts stay far below 2^24
    for (int c = begin; c < end; ++c) {
      const float v = x[c];
      if (v == v && pie_order_key(v) >= candidate) count += 1.0f;
    }
    if (pie_block_sum(count, sums) >= static_cast<float>(k)) threshold = candidate;
  }

  int above = 0, ties = 0;
  for (int c = begin; c < end; ++c) {
    const float v = x[c];
    if (v != v) continue;
    const unsigned key = pie_order_key(v);
    above += key > threshold;
    ties += key == threshold;
  }
  int total_above, total_ties;
  int slot = pie_block_exclusive_scan(above, scan, total_above);
  int tie_rank = pie_block_exclusive_scan(ties, scan, total_ties);
  const int ties_taken = pie_min(total_ties, k - total_above);
  for (int c = begin; c < end; ++c) {
    const float v = x[c];
    if (v != v) continue;
    const unsigned key = pie_order_key(v);
    if (key > threshold) {
      best_values[slot] = v;
      best_indices[slot++] = c;
    } else if (key == threshold) {
      if (tie_rank < ties_taken) {
        best_values[total_above + tie_rank] = v;
        best_indices[total_above + tie_rank] = c;
      }
      ++tie_rank;
    }
  }
  int size = 1;
  while (size < k) size <<= 1;
  for (int i = total_above + ties_taken + static_cast<int>(threadIdx.x); i < size; i += blockDim.x) {
    best_values[i] = pie_neg_inf();  // fewer than k non-NaN values: pad, sorting last
    best_indices[i] = 0x7fffffff;
  }
  __syncthreads();

  for (int width = 2; width <= size; width <<= 1) {
    for (int stride = width / 2; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < size; i += blockDim.x) {
        const int j = i ^ stride;
        if (j > i) {
          const bool ordered = pie_precedes(best_values[i], best_indices[i], best_values[j], best_indices[j]);
          if ((i & width) == 0 ? !ordered : ordered) {
            const float v = best_values[i];
            const int index = best_indices[i];
            best_values[i] = best_values[j];
            best_indices[i] = best_indices[j];
            best_values[j] = v;
            best_indices[j] = index;
          }
        }
      }
      __syncthreads();
    }
  }

  const long long out = static_cast<long long>(blockIdx.x) * k;
  for (int i = threadIdx.x; i < k; i += blockDim.x) {
    args.values[out + i] = best_values[i];
    args.indices[out + i] = best_indices[i] == 0x7fffffff ? -1 : best_indices[i];
  }
}

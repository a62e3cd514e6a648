// Projections: out = x W^T (+ bias) (+ residual), optionally on RMS-normalized x (rms_norm_linear),
// optionally the gated pair silu(x Wg^T) * (x Wu^T) (rms_norm_gate_up_silu). W is [n, k] in float,
// half, bfloat16 or one of GGML's block types (Q8_0, Q4_0, Q4_1, Q5_0 and the K-quants Q4_K, Q5_K,
// Q6_K: read as stored, dequantized in registers); x and out are float32 and every sum is float32.
// Three implementations: gemv (a warp per output column, for a few rows: decode), a tiled SIMT
// GEMM, and a tensor-core GEMM (mma.sync, sm_80+, float and 16-bit weights) for prefill.

#define PIE_GEMV_ROWS 8
#define PIE_TILE_M 64
#define PIE_TILE_N 64
#define PIE_TILE_K 16
#define PIE_TC_K 32
#define PIE_TILE_STRIDE (PIE_TILE_N + 1)

// The RMS prologue, when there is one (norm_w set): x[row] / sqrt(mean(x[row]^2) + eps) * norm_w.
// Kernels load x scaled by norm_w alone and sum the row's squares of plain x on the way; the row's
// 1 / rms factors out of every dot product and multiplies them in the epilogue.
PIE_DEVICE float pie_gemm_norm(const GemmArgs& a, int k) { return a.norm_w == nullptr ? 1.0f : a.norm_w[k]; }

// The factor of a row's dot products: its 1 / rms given its sum of squares (1 without a norm).
PIE_DEVICE float pie_row_scale(const GemmArgs& a, float squares) {
  return a.norm_w == nullptr ? 1.0f : pie_inv_rms(squares, a.k, a.eps);
}

// The epilogue of one output: `acc` is x.W[col] (the gate when paired), `up` is x.W[out_cols + col],
// both before the row's `scale`.
PIE_DEVICE void pie_gemm_store(const GemmArgs& a, int row, int col, float acc, float up, float scale) {
  const int out_cols = a.paired ? a.n / 2 : a.n;
  float v = acc * scale;
  if (a.paired) {
    v = pie_silu(v) * (up * scale);
  } else if (a.bias != nullptr) {
    v += a.bias[col];
  }
  const long long o = static_cast<long long>(row) * out_cols + col;
  if (a.residual != nullptr) v += a.residual[o];
  a.out[o] = v;
}

// ---------------------------------------------------------------------------------------------
// gemv: grid (ceil(out_cols / warps per block), ceil(rows / 8)); each warp computes one output
// column for up to 8 rows, reading its weight row once with 8-wide vector loads when k % 8 == 0.
// ---------------------------------------------------------------------------------------------

template <typename W>
PIE_DEVICE void pie_gemv(const GemmArgs& a) {
  const int lane = threadIdx.x % PIE_WARP, warp = threadIdx.x / PIE_WARP, warps = blockDim.x / PIE_WARP;
  const int out_cols = a.paired ? a.n / 2 : a.n;
  const int col = blockIdx.x * warps + warp;
  const int row0 = blockIdx.y * PIE_GEMV_ROWS;
  const int rows = pie_min(PIE_GEMV_ROWS, a.rows - row0);
  if (col >= out_cols) return;  // whole warps leave together: the shuffles below stay convergent
  const W* w = static_cast<const W*>(a.w);
  const W* gate = pie_row(w, col, a.k);
  const W* up = pie_row(w, col + out_cols, a.k);  // read only when paired
  float acc[PIE_GEMV_ROWS], acc_up[PIE_GEMV_ROWS], squares[PIE_GEMV_ROWS];
#pragma unroll
  for (int r = 0; r < PIE_GEMV_ROWS; ++r) acc[r] = acc_up[r] = squares[r] = 0.0f;
  if (a.k % 8 == 0) {
    for (int k = lane * 8; k < a.k; k += PIE_WARP * 8) {
      float wv[8], uv[8], nv[8];
      pie_load8_at(gate, k, wv);
      if (a.paired) pie_load8_at(up, k, uv);
      if (a.norm_w != nullptr) pie_load8(a.norm_w + k, nv);
#pragma unroll
      for (int r = 0; r < PIE_GEMV_ROWS; ++r) {
        if (r < rows) {
          float xv[8];
          pie_load8(a.x + static_cast<long long>(row0 + r) * a.k + k, xv);
          if (a.norm_w != nullptr) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              squares[r] += xv[e] * xv[e];
              xv[e] *= nv[e];
            }
          }
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r] += wv[e] * xv[e];
          if (a.paired) {
#pragma unroll
            for (int e = 0; e < 8; ++e) acc_up[r] += uv[e] * xv[e];
          }
        }
      }
    }
  } else {
    for (int k = lane; k < a.k; k += PIE_WARP) {
      const float wk = pie_load_at(gate, k);
      const float uk = a.paired ? pie_load_at(up, k) : 0.0f;
      const float nk = pie_gemm_norm(a, k);
#pragma unroll
      for (int r = 0; r < PIE_GEMV_ROWS; ++r) {
        if (r < rows) {
          const float x = a.x[static_cast<long long>(row0 + r) * a.k + k];
          squares[r] += x * x;
          acc[r] += wk * x * nk;
          acc_up[r] += uk * x * nk;
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < PIE_GEMV_ROWS; ++r) {
    if (r < rows) {  // `rows` is the same for the whole warp
      const float s = pie_warp_sum(acc[r]);
      const float u = a.paired ? pie_warp_sum(acc_up[r]) : 0.0f;
      const float scale = pie_row_scale(a, a.norm_w == nullptr ? 0.0f : pie_warp_sum(squares[r]));
      if (lane == 0) pie_gemm_store(a, row0 + r, col, s, u, scale);
    }
  }
}

PIE_KERNEL(pie_gemv_f32, GemmArgs, 128) { pie_gemv<float>(args); }
PIE_KERNEL(pie_gemv_f16, GemmArgs, 128) { pie_gemv<pie_f16>(args); }
PIE_KERNEL(pie_gemv_bf16, GemmArgs, 128) { pie_gemv<pie_bf16>(args); }
PIE_KERNEL(pie_gemv_q8_0, GemmArgs, 128) { pie_gemv<pie_q8_0>(args); }
PIE_KERNEL(pie_gemv_q4_0, GemmArgs, 128) { pie_gemv<pie_q4_0>(args); }
PIE_KERNEL(pie_gemv_q4_1, GemmArgs, 128) { pie_gemv<pie_q4_1>(args); }
PIE_KERNEL(pie_gemv_q5_0, GemmArgs, 128) { pie_gemv<pie_q5_0>(args); }
PIE_KERNEL(pie_gemv_q4_k, GemmArgs, 128) { pie_gemv<pie_q4_k>(args); }
PIE_KERNEL(pie_gemv_q5_k, GemmArgs, 128) { pie_gemv<pie_q5_k>(args); }
PIE_KERNEL(pie_gemv_q6_k, GemmArgs, 128) { pie_gemv<pie_q6_k>(args); }

// ---------------------------------------------------------------------------------------------
// Tiled GEMMs: grid (ceil(out_cols / (64, or 32 when paired)), ceil(rows / 64)). A block's
// weight tile holds 64 weight rows: unpaired, rows n0..n0+63; paired, 32 gate rows and the 32
// matching up rows, so both halves of each output meet in the block.
// ---------------------------------------------------------------------------------------------

// Weight row behind row `i` of this block's weight tile, or -1 past the end.
PIE_DEVICE int pie_tile_weight_row(const GemmArgs& a, int i) {
  if (!a.paired) {
    const int r = blockIdx.x * PIE_TILE_N + i;
    return r < a.n ? r : -1;
  }
  const int half = PIE_TILE_N / 2, out_cols = a.n / 2;
  const int c = blockIdx.x * half + i % half;
  if (c >= out_cols) return -1;
  return i < half ? c : out_cols + c;
}

// Writes the block's outputs from its accumulated tile [64][PIE_TILE_STRIDE] in shared memory;
// `squares` holds each tile row's sum of squares of x (read only with a norm).
PIE_DEVICE void pie_gemm_epilogue(const GemmArgs& a, const float* tile, const float* squares) {
  const int row0 = blockIdx.y * PIE_TILE_M;
  if (!a.paired) {
    for (int i = threadIdx.x; i < PIE_TILE_M * PIE_TILE_N; i += blockDim.x) {
      const int m = i / PIE_TILE_N, n = i % PIE_TILE_N;
      const int col = blockIdx.x * PIE_TILE_N + n;
      if (row0 + m < a.rows && col < a.n) {
        pie_gemm_store(a, row0 + m, col, tile[m * PIE_TILE_STRIDE + n], 0.0f, pie_row_scale(a, squares[m]));
      }
    }
    return;
  }
  const int half = PIE_TILE_N / 2;
  for (int i = threadIdx.x; i < PIE_TILE_M * half; i += blockDim.x) {
    const int m = i / half, n = i % half;
    const int col = blockIdx.x * half + n;
    if (row0 + m < a.rows && col < a.n / 2) {
      pie_gemm_store(a, row0 + m, col, tile[m * PIE_TILE_STRIDE + n], tile[m * PIE_TILE_STRIDE + half + n],
                     pie_row_scale(a, squares[m]));
    }
  }
}

// SIMT: 256 threads, each accumulating a 4x4 patch of the 64x64 tile over k-steps of 16.
template <typename W>
PIE_DEVICE void pie_gemm_simt(const GemmArgs& a) {
  __shared__ float xs[PIE_TILE_K][PIE_TILE_M];
  __shared__ float ws[PIE_TILE_K][PIE_TILE_N];
  __shared__ float tile[PIE_TILE_M * PIE_TILE_STRIDE];
  __shared__ float row_squares[PIE_TILE_M];
  const int tid = threadIdx.x;
  const int tx = tid % 16, ty = tid / 16;
  const int row0 = blockIdx.y * PIE_TILE_M;
  const W* w = static_cast<const W*>(a.w);
  const int load_row = tid / 4, load_k = (tid % 4) * 4;
  const int x_row = row0 + load_row;
  const int w_row = pie_tile_weight_row(a, load_row);
  float squares = 0.0f;  // of row x_row, over this thread's k
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
  for (int k0 = 0; k0 < a.k; k0 += PIE_TILE_K) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int k = k0 + load_k + e;
      const float x = (x_row < a.rows && k < a.k) ? a.x[static_cast<long long>(x_row) * a.k + k] : 0.0f;
      squares += x * x;
      xs[load_k + e][load_row] = k < a.k ? x * pie_gemm_norm(a, k) : 0.0f;
      ws[load_k + e][load_row] = (w_row >= 0 && k < a.k) ? pie_load_at(pie_row(w, w_row, a.k), k) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < PIE_TILE_K; ++kk) {
      float xv[4], wv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        xv[i] = xs[kk][ty * 4 + i];
        wv[i] = ws[kk][tx * 4 + i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += xv[i] * wv[j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) tile[(ty * 4 + i) * PIE_TILE_STRIDE + tx * 4 + j] = acc[i][j];
  // The four threads loading a row are neighbouring lanes.
  squares += pie_shfl_xor(squares, 1);
  squares += pie_shfl_xor(squares, 2);
  if (tid % 4 == 0) row_squares[load_row] = squares;
  __syncthreads();
  pie_gemm_epilogue(a, tile, row_squares);
}

PIE_KERNEL(pie_gemm_f32, GemmArgs, 256) { pie_gemm_simt<float>(args); }
PIE_KERNEL(pie_gemm_f16, GemmArgs, 256) { pie_gemm_simt<pie_f16>(args); }
PIE_KERNEL(pie_gemm_bf16, GemmArgs, 256) { pie_gemm_simt<pie_bf16>(args); }
PIE_KERNEL(pie_gemm_q8_0, GemmArgs, 256) { pie_gemm_simt<pie_q8_0>(args); }
PIE_KERNEL(pie_gemm_q4_0, GemmArgs, 256) { pie_gemm_simt<pie_q4_0>(args); }
PIE_KERNEL(pie_gemm_q4_1, GemmArgs, 256) { pie_gemm_simt<pie_q4_1>(args); }
PIE_KERNEL(pie_gemm_q5_0, GemmArgs, 256) { pie_gemm_simt<pie_q5_0>(args); }
PIE_KERNEL(pie_gemm_q4_k, GemmArgs, 256) { pie_gemm_simt<pie_q4_k>(args); }
PIE_KERNEL(pie_gemm_q5_k, GemmArgs, 256) { pie_gemm_simt<pie_q5_k>(args); }
PIE_KERNEL(pie_gemm_q6_k, GemmArgs, 256) { pie_gemm_simt<pie_q6_k>(args); }

#if PIE_HAS_MMA
// ---------------------------------------------------------------------------------------------
// Tensor cores: 256 threads = two groups of 4 warps (below); in a group the warps form a 2x2
// arrangement, each owning a 32x32 quarter of the 64x64 tile as 2x4 mma tiles of 16x8. Activations stay float32 in precision: for 16-bit weights
// x is split as hi + lo in the weight's type (W.hi + W.lo keeps ~22 bits of x for half, ~16 for
// bfloat16); for float32 weights both operands are split in TF32 (3xTF32, close to float32).
// ---------------------------------------------------------------------------------------------

PIE_DEVICE void pie_split(float x, pie_f16& hi, pie_f16& lo) {
  hi = pie_f32_to_f16(x);
  lo = pie_f32_to_f16(x - pie_f16_to_f32(hi));
}

PIE_DEVICE void pie_split(float x, pie_bf16& hi, pie_bf16& lo) {
  hi = pie_f32_to_bf16(x);
  lo = pie_f32_to_bf16(x - pie_bf16_to_f32(hi));
}

PIE_DEVICE void pie_mma16(const pie_f16&, float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  pie_mma_f16(d, a, b);
}

PIE_DEVICE void pie_mma16(const pie_bf16&, float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  pie_mma_bf16(d, a, b);
}

PIE_DEVICE unsigned pie_pack(unsigned short lo, unsigned short hi) {
  return static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16);
}

// Shared-memory rows are padded by 16 bytes against bank conflicts.
#define PIE_TC_XS (PIE_TC_K + 4)

// One k-step of a warp's 32x32 quarter: the A fragments of its two 16-row tiles and the B
// fragments of its four 8-column tiles are made first, then each pass of mma instructions runs
// over all eight accumulators, so that consecutive mma never wait on each other (an accumulator's
// next mma comes eight instructions later). Every accumulator still adds its products in the same
// order.

// A k-step of 16 for 16-bit weights (H is pie_f16 or pie_bf16): x = hi + lo in H, lo first.
template <typename H>
PIE_DEVICE void pie_tc_step(const float (*xs)[PIE_TC_XS], const H (*ws)[PIE_TC_K + 8], int kb, int wm, int wn,
                            float (&acc)[2][4][4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  unsigned a_hi[2][4], a_lo[2][4], b[4][2];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
    const int r = wm * 32 + mi * 16 + g;
    // Fragment element (row, col) pairs of A, in register order.
    const int rows[4] = {r, r + 8, r, r + 8};
    const int cols[4] = {kb + 2 * t, kb + 2 * t, kb + 2 * t + 8, kb + 2 * t + 8};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      H h0, l0, h1, l1;
      pie_split(xs[rows[j]][cols[j]], h0, l0);
      pie_split(xs[rows[j]][cols[j] + 1], h1, l1);
      a_hi[mi][j] = pie_pack(h0.bits, h1.bits);
      a_lo[mi][j] = pie_pack(l0.bits, l1.bits);
    }
  }
#pragma unroll
  for (int ni = 0; ni < 4; ++ni) {
    const int n = wn * 32 + ni * 8 + g;
    b[ni][0] = pie_pack(ws[n][kb + 2 * t].bits, ws[n][kb + 2 * t + 1].bits);
    b[ni][1] = pie_pack(ws[n][kb + 2 * t + 8].bits, ws[n][kb + 2 * t + 9].bits);
  }
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) pie_mma16(ws[0][0], acc[mi][ni], a_lo[mi], b[ni]);
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) pie_mma16(ws[0][0], acc[mi][ni], a_hi[mi], b[ni]);
}

// A k-step of 8 for float32 weights, 3xTF32: small*big, then big*small, then big*big.
PIE_DEVICE void pie_tc_step(const float (*xs)[PIE_TC_XS], const float (*ws)[PIE_TC_XS], int kb, int wm, int wn,
                            float (&acc)[2][4][4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  unsigned a_big[2][4], a_small[2][4], b_big[4][2], b_small[4][2];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
    const int r = wm * 32 + mi * 16 + g;
    const int rows[4] = {r, r + 8, r, r + 8};
    const int cols[4] = {kb + t, kb + t, kb + t + 4, kb + t + 4};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float x = xs[rows[j]][cols[j]];
      a_big[mi][j] = pie_to_tf32(x);
      a_small[mi][j] = pie_to_tf32(x - pie_as_float(a_big[mi][j]));
    }
  }
#pragma unroll
  for (int ni = 0; ni < 4; ++ni) {
    const int n = wn * 32 + ni * 8 + g;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float v = ws[n][kb + t + 4 * j];
      b_big[ni][j] = pie_to_tf32(v);
      b_small[ni][j] = pie_to_tf32(v - pie_as_float(b_big[ni][j]));
    }
  }
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) pie_mma_tf32(acc[mi][ni], a_small[mi], b_big[ni]);
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) pie_mma_tf32(acc[mi][ni], a_big[mi], b_small[ni]);
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) pie_mma_tf32(acc[mi][ni], a_big[mi], b_big[ni]);
}

// The block's 8 warps form PIE_TC_SPLITS groups of 4; group g takes k-steps g, g + 2, ... of the
// tile and the groups' sums meet in shared memory at the end: twice the warps of one 64x64 tile,
// for the small grids of decode batches and short prompts.
// Each group stages a k-step's tiles in registers, so that all its global loads are in flight at
// once and the next k-step's loads overlap this one's mma work. Thread t of a group (t < 128)
// holds 4 runs of 4 consecutive k: run i is tile row (t + 128 i) / 8, columns ((t + 128 i) % 8) * 4
// .. + 3, of the activations (as loaded) and of the weights; the four runs share their columns, so
// the norm weights of those columns (with an RMS prologue) are held once.
// The kernel is held to 128 registers, two blocks per multiprocessor: at 148 (what the compiler
// chose unbounded) one block ran per multiprocessor and large GEMMs took longer.
#define PIE_TC_THREADS 256
#define PIE_TC_SPLITS 2
#define PIE_TC_GROUP_THREADS (PIE_TC_THREADS / PIE_TC_SPLITS)
#define PIE_TC_RUNS (PIE_TILE_M * PIE_TC_K / 4 / PIE_TC_GROUP_THREADS)

template <typename W>
struct PieTcStage {
  float x[PIE_TC_RUNS][4];
  float norm[4];
  W w[PIE_TC_RUNS][4];
};

struct alignas(8) pie_u32x2 { unsigned x, y; };

// Four consecutive values in their stored type; `p` is aligned to four of them.
PIE_DEVICE void pie_load4_raw(const float* p, float (&v)[4]) {
  const pie_vec4 q = *reinterpret_cast<const pie_vec4*>(p);
  v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}

template <typename H>
PIE_DEVICE void pie_load4_raw(const H* p, H (&v)[4]) {
  const pie_u32x2 q = *reinterpret_cast<const pie_u32x2*>(p);
  v[0].bits = static_cast<unsigned short>(q.x & 0xffffu);
  v[1].bits = static_cast<unsigned short>(q.x >> 16);
  v[2].bits = static_cast<unsigned short>(q.y & 0xffffu);
  v[3].bits = static_cast<unsigned short>(q.y >> 16);
}

PIE_DEVICE int pie_tc_run(int i) { return threadIdx.x % PIE_TC_GROUP_THREADS + i * PIE_TC_GROUP_THREADS; }
PIE_DEVICE int pie_tc_run_row(int i) { return pie_tc_run(i) / (PIE_TC_K / 4); }
PIE_DEVICE int pie_tc_run_col(int i) { return pie_tc_run(i) % (PIE_TC_K / 4) * 4; }

// Issues the loads of k-step k0 (nothing waits for them here).
template <typename W>
PIE_DEVICE void pie_tc_fetch(const GemmArgs& a, const int (&w_rows)[PIE_TC_RUNS], int k0, PieTcStage<W>& st) {
  const int row0 = blockIdx.y * PIE_TILE_M;
  const W* w = static_cast<const W*>(a.w);
  const W zero = W();
  const bool vector = a.k % 4 == 0 && k0 + PIE_TC_K <= a.k;
  const int k_norm = k0 + pie_tc_run_col(0);
  if (a.norm_w != nullptr) {
    if (vector) {
      pie_load4_raw(a.norm_w + k_norm, st.norm);
    } else {
#pragma unroll
      for (int c = 0; c < 4; ++c) st.norm[c] = k_norm + c < a.k ? a.norm_w[k_norm + c] : 0.0f;
    }
  }
#pragma unroll
  for (int i = 0; i < PIE_TC_RUNS; ++i) {
    const int row = row0 + pie_tc_run_row(i), k = k0 + pie_tc_run_col(i);
    const long long x_at = static_cast<long long>(row) * a.k + k;
    const long long w_at = static_cast<long long>(w_rows[i]) * a.k + k;
    if (vector) {
      if (row < a.rows) {
        pie_load4_raw(a.x + x_at, st.x[i]);
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) st.x[i][c] = 0.0f;
      }
      if (w_rows[i] >= 0) {
        pie_load4_raw(w + w_at, st.w[i]);
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) st.w[i][c] = zero;
      }
    } else {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const bool inside = k + c < a.k;
        st.x[i][c] = row < a.rows && inside ? a.x[x_at + c] : 0.0f;
        st.w[i][c] = w_rows[i] >= 0 && inside ? w[w_at + c] : zero;
      }
    }
  }
}

// Writes a staged k-step into shared memory, x scaled by the norm weight when there is a norm, and
// adds the squares of its x to each run's row sum.
template <typename W, int WS>
PIE_DEVICE void pie_tc_store(const GemmArgs& a, const PieTcStage<W>& st, float (&squares)[PIE_TC_RUNS],
                             float (*xs)[PIE_TC_XS], W (*ws)[WS]) {
#pragma unroll
  for (int i = 0; i < PIE_TC_RUNS; ++i) {
    const int m = pie_tc_run_row(i), kk = pie_tc_run_col(i);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float x = st.x[i][c];
      if (a.norm_w != nullptr) squares[i] += x * x;
      xs[m][kk + c] = a.norm_w == nullptr ? x : x * st.norm[c];
      ws[m][kk + c] = st.w[i][c];
    }
  }
}

// Split along k (gridDim.z blocks per output tile, for grids too small to fill the GPU: decode
// batches): each block has summed its share of the k-steps into `tile` and `squares`. It writes
// them to its slot of a.partial and counts its arrival on the tile's counter in a.arrivals; the
// last to arrive resets the counter, sums every slot in split order (the result does not depend on
// which block came last) and returns true: it alone runs the epilogue.
PIE_DEVICE bool pie_gemm_split_meet(const GemmArgs& a, float* tile, float* squares) {
  constexpr int slot = PIE_TILE_M * PIE_TILE_N + PIE_TILE_M;
  const int tile_id = blockIdx.y * gridDim.x + blockIdx.x;
  const int rows = a.rows - static_cast<int>(blockIdx.y) * PIE_TILE_M < PIE_TILE_M
                       ? a.rows - static_cast<int>(blockIdx.y) * PIE_TILE_M
                       : PIE_TILE_M;
  const long long slots = static_cast<long long>(tile_id) * gridDim.z;
  float* mine = a.partial + (slots + blockIdx.z) * slot;
  for (int i = threadIdx.x; i < rows * PIE_TILE_N; i += blockDim.x) {
    mine[i] = tile[i / PIE_TILE_N * PIE_TILE_STRIDE + i % PIE_TILE_N];
  }
  for (int i = threadIdx.x; i < rows; i += blockDim.x) mine[PIE_TILE_M * PIE_TILE_N + i] = squares[i];
  pie_fence();
  __syncthreads();
  __shared__ int arrived_last;
  if (threadIdx.x == 0) arrived_last = pie_atomic_add(a.arrivals + tile_id, 1) == static_cast<int>(gridDim.z) - 1;
  __syncthreads();
  if (!arrived_last) return false;
  pie_fence();
  // Volatile: the other blocks' slots are read from L2, never from a stale line of this SM's L1.
  const volatile float* all = a.partial + slots * slot;
  for (int i = threadIdx.x; i < rows * PIE_TILE_N; i += blockDim.x) {
    float sum = 0.0f;
    for (int z = 0; z < static_cast<int>(gridDim.z); ++z) sum += all[z * slot + i];
    tile[i / PIE_TILE_N * PIE_TILE_STRIDE + i % PIE_TILE_N] = sum;
  }
  for (int i = threadIdx.x; i < rows; i += blockDim.x) {
    float sum = 0.0f;
    for (int z = 0; z < static_cast<int>(gridDim.z); ++z) sum += all[z * slot + PIE_TILE_M * PIE_TILE_N + i];
    squares[i] = sum;
  }
  if (threadIdx.x == 0) a.arrivals[tile_id] = 0;
  __syncthreads();
  return true;
}

template <typename W>
PIE_DEVICE void pie_gemm_tc(const GemmArgs& a) {
  // Per group: activations [64][PIE_TC_XS] floats and weights [64][PIE_TC_K + 16 bytes]; after the
  // k loop the same memory holds the 64x64 output tile.
  constexpr int ws_row = PIE_TC_K + 16 / sizeof(W);
  constexpr int xs_bytes = PIE_TILE_M * PIE_TC_XS * 4, ws_bytes = PIE_TILE_N * ws_row * sizeof(W);
  constexpr int stage_bytes = PIE_TC_SPLITS * (xs_bytes + ws_bytes);
  constexpr int tile_bytes = PIE_TILE_M * PIE_TILE_STRIDE * 4;
  __shared__ float smem_floats[(stage_bytes > tile_bytes ? stage_bytes : tile_bytes) / 4];
  unsigned char* smem = reinterpret_cast<unsigned char*>(smem_floats);
  const int warp = threadIdx.x / 32, split = warp / 4;
  const int wm = warp % 2, wn = warp / 2 % 2;
  unsigned char* stage_memory = smem + split * (xs_bytes + ws_bytes);
  float (*xs)[PIE_TC_XS] = reinterpret_cast<float (*)[PIE_TC_XS]>(stage_memory);
  W (*ws)[ws_row] = reinterpret_cast<W (*)[ws_row]>(stage_memory + xs_bytes);
  float acc[2][4][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mi][ni][j] = 0.0f;
  __shared__ float row_squares[PIE_TILE_M];
  int w_rows[PIE_TC_RUNS];
  float squares[PIE_TC_RUNS];
#pragma unroll
  for (int i = 0; i < PIE_TC_RUNS; ++i) {
    w_rows[i] = pie_tile_weight_row(a, pie_tc_run_row(i));
    squares[i] = 0.0f;
  }
  // Every group runs the same number of rounds (the barriers are block-wide); a k-step past the
  // end loads zeros and skips its mma work. With a split along k, block z takes its share of them.
  const int rounds = (a.k + PIE_TC_SPLITS * PIE_TC_K - 1) / (PIE_TC_SPLITS * PIE_TC_K);
  const int first = rounds * blockIdx.z / gridDim.z, last = rounds * (blockIdx.z + 1) / gridDim.z;
  constexpr int step = sizeof(W) == 4 ? 8 : 16;
  PieTcStage<W> stage;
  pie_tc_fetch(a, w_rows, (first * PIE_TC_SPLITS + split) * PIE_TC_K, stage);
  for (int round = first; round < last; ++round) {
    const int k0 = (round * PIE_TC_SPLITS + split) * PIE_TC_K;
    pie_tc_store(a, stage, squares, xs, ws);
    __syncthreads();
    if (round + 1 < last) pie_tc_fetch(a, w_rows, k0 + PIE_TC_SPLITS * PIE_TC_K, stage);
    if (k0 < a.k) {
#pragma unroll
      for (int kb = 0; kb < PIE_TC_K; kb += step) pie_tc_step(xs, ws, kb, wm, wn, acc);
    }
    __syncthreads();
  }
  float* tile = reinterpret_cast<float*>(smem);
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // A run's row is shared by eight neighbouring lanes: their sums meet in the first of them.
#pragma unroll
  for (int i = 0; i < PIE_TC_RUNS; ++i) {
#pragma unroll
    for (int mask = 1; mask < PIE_TC_K / 4; mask <<= 1) squares[i] += pie_shfl_xor(squares[i], mask);
  }
  for (int s = PIE_TC_SPLITS - 1; s >= 0; --s) {
    if (split == s) {
      const bool first = s == PIE_TC_SPLITS - 1;
      if (lane % (PIE_TC_K / 4) == 0) {
#pragma unroll
        for (int i = 0; i < PIE_TC_RUNS; ++i) {
          const int m = pie_tc_run_row(i);
          row_squares[m] = (first ? 0.0f : row_squares[m]) + squares[i];
        }
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          const int r = wm * 32 + mi * 16 + g, c = wn * 32 + ni * 8 + 2 * t;
          float* top = tile + r * PIE_TILE_STRIDE + c;
          float* bottom = tile + (r + 8) * PIE_TILE_STRIDE + c;
          top[0] = (first ? 0.0f : top[0]) + acc[mi][ni][0];
          top[1] = (first ? 0.0f : top[1]) + acc[mi][ni][1];
          bottom[0] = (first ? 0.0f : bottom[0]) + acc[mi][ni][2];
          bottom[1] = (first ? 0.0f : bottom[1]) + acc[mi][ni][3];
        }
    }
    __syncthreads();
  }
  if (gridDim.z > 1 && !pie_gemm_split_meet(a, tile, row_squares)) return;
  pie_gemm_epilogue(a, tile, row_squares);
}

PIE_KERNEL_BLOCKS(pie_gemm_tc_f32, GemmArgs, PIE_TC_THREADS, 2) { pie_gemm_tc<float>(args); }
PIE_KERNEL_BLOCKS(pie_gemm_tc_f16, GemmArgs, PIE_TC_THREADS, 2) { pie_gemm_tc<pie_f16>(args); }
PIE_KERNEL_BLOCKS(pie_gemm_tc_bf16, GemmArgs, PIE_TC_THREADS, 2) { pie_gemm_tc<pie_bf16>(args); }
#endif

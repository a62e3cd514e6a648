// Helpers shared by every kernel file; included after one of the compat_*.cuh headers.
// Blocks are one-dimensional everywhere, and their size is a multiple of the warp size.

#define PIE_MAX_HEAD_DIM 256

PIE_DEVICE int pie_min(int a, int b) { return a < b ? a : b; }
PIE_DEVICE int pie_max(int a, int b) { return a > b ? a : b; }
PIE_DEVICE float pie_nan() { return pie_as_float(0x7fc00000u); }
PIE_DEVICE float pie_neg_inf() { return pie_as_float(0xff800000u); }

// bfloat16 is the top half of a float; conversions are plain bit operations on every backend.
struct pie_bf16 { unsigned short bits; };

PIE_DEVICE float pie_bf16_to_f32(pie_bf16 v) { return pie_as_float(static_cast<unsigned>(v.bits) << 16); }

PIE_DEVICE pie_bf16 pie_f32_to_bf16(float f) {
  unsigned u = pie_as_uint(f);
  pie_bf16 r;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    r.bits = static_cast<unsigned short>((u >> 16) | 0x40u);  // keep NaN a (quiet) NaN
    return r;
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  r.bits = static_cast<unsigned short>(u >> 16);
  return r;
}

// Weights are stored as float, IEEE half or bfloat16 and always read as float.
PIE_DEVICE float pie_load(const float* p) { return *p; }
PIE_DEVICE float pie_load(const pie_f16* p) { return pie_f16_to_f32(*p); }
PIE_DEVICE float pie_load(const pie_bf16* p) { return pie_bf16_to_f32(*p); }

struct alignas(16) pie_vec4 { float x, y, z, w; };
struct alignas(16) pie_u32x4 { unsigned x, y, z, w; };

// Eight consecutive values as floats; `p` is 16-byte aligned.
PIE_DEVICE void pie_load8(const float* p, float (&out)[8]) {
  const pie_vec4 a = reinterpret_cast<const pie_vec4*>(p)[0];
  const pie_vec4 b = reinterpret_cast<const pie_vec4*>(p)[1];
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

PIE_DEVICE void pie_unpack_f16(unsigned pair, float& lo, float& hi) {
  pie_f16 a, b;
  a.bits = static_cast<unsigned short>(pair & 0xffffu);
  b.bits = static_cast<unsigned short>(pair >> 16);
  lo = pie_f16_to_f32(a);
  hi = pie_f16_to_f32(b);
}

PIE_DEVICE void pie_load8(const pie_f16* p, float (&out)[8]) {
  const pie_u32x4 v = *reinterpret_cast<const pie_u32x4*>(p);
  pie_unpack_f16(v.x, out[0], out[1]);
  pie_unpack_f16(v.y, out[2], out[3]);
  pie_unpack_f16(v.z, out[4], out[5]);
  pie_unpack_f16(v.w, out[6], out[7]);
}

PIE_DEVICE void pie_load8(const pie_bf16* p, float (&out)[8]) {
  const pie_u32x4 v = *reinterpret_cast<const pie_u32x4*>(p);
  out[0] = pie_as_float(v.x << 16); out[1] = pie_as_float(v.x & 0xffff0000u);
  out[2] = pie_as_float(v.y << 16); out[3] = pie_as_float(v.y & 0xffff0000u);
  out[4] = pie_as_float(v.z << 16); out[5] = pie_as_float(v.z & 0xffff0000u);
  out[6] = pie_as_float(v.w << 16); out[7] = pie_as_float(v.w & 0xffff0000u);
}

// A weight row and its values: float types are plain arrays; GGML's block types (gguf.quants, 32
// weights a block, an IEEE half scale first, whole blocks along a row) are arrays of blocks. Rows and
// blocks are 2-byte aligned; `k` of pie_load8_at is a multiple of 8, so its 8 values share a block.
struct pie_q8_0 { unsigned short d; signed char qs[32]; };        // d * qs[j]
struct pie_q4_0 { unsigned short d; unsigned char qs[16]; };      // d * (nibble - 8)
struct pie_q4_1 { unsigned short d, m; unsigned char qs[16]; };   // d * nibble + m
// Nibble j of a Q4 block: the low half of byte j for j < 16, the high half of byte j - 16 above.

template <typename W>
PIE_DEVICE const W* pie_row(const W* w, long long row, int cols) { return w + row * cols; }
template <typename Q>
PIE_DEVICE const Q* pie_block_row(const Q* w, long long row, int cols) { return w + row * (cols / 32); }
PIE_DEVICE const pie_q8_0* pie_row(const pie_q8_0* w, long long row, int cols) { return pie_block_row(w, row, cols); }
PIE_DEVICE const pie_q4_0* pie_row(const pie_q4_0* w, long long row, int cols) { return pie_block_row(w, row, cols); }
PIE_DEVICE const pie_q4_1* pie_row(const pie_q4_1* w, long long row, int cols) { return pie_block_row(w, row, cols); }

template <typename W>
PIE_DEVICE float pie_load_at(const W* row, int k) { return pie_load(row + k); }
template <typename W>
PIE_DEVICE void pie_load8_at(const W* row, int k, float (&out)[8]) { pie_load8(row + k, out); }

PIE_DEVICE float pie_half_bits(unsigned short bits) {
  pie_f16 h;
  h.bits = bits;
  return pie_f16_to_f32(h);
}

// Eight bytes from a 2-byte aligned address, as four 16-bit loads (little-endian).
PIE_DEVICE void pie_load_bytes8(const unsigned char* p, unsigned (&out)[8]) {
  const unsigned short* s = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned v = s[i];
    out[2 * i] = v & 0xffu;
    out[2 * i + 1] = v >> 8;
  }
}

PIE_DEVICE unsigned pie_nibble(const unsigned char* qs, int j) { return j < 16 ? qs[j] & 0xfu : qs[j - 16] >> 4; }

// Nibbles j .. j + 7 of a Q4 block (j a multiple of 8).
PIE_DEVICE void pie_nibbles8(const unsigned char* qs, int j, unsigned (&out)[8]) {
  pie_load_bytes8(qs + j % 16, out);
  const unsigned shift = j < 16 ? 0u : 4u;
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = (out[e] >> shift) & 0xfu;
}

PIE_DEVICE float pie_load_at(const pie_q8_0* row, int k) {
  const pie_q8_0& b = row[k / 32];
  return pie_half_bits(b.d) * static_cast<float>(b.qs[k % 32]);
}

PIE_DEVICE void pie_load8_at(const pie_q8_0* row, int k, float (&out)[8]) {
  const pie_q8_0& b = row[k / 32];
  const float d = pie_half_bits(b.d);
  unsigned q[8];
  pie_load_bytes8(reinterpret_cast<const unsigned char*>(b.qs) + k % 32, q);
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = d * static_cast<float>(static_cast<int>(q[e] ^ 0x80u) - 128);
}

PIE_DEVICE float pie_load_at(const pie_q4_0* row, int k) {
  const pie_q4_0& b = row[k / 32];
  return pie_half_bits(b.d) * (static_cast<float>(pie_nibble(b.qs, k % 32)) - 8.0f);
}

PIE_DEVICE void pie_load8_at(const pie_q4_0* row, int k, float (&out)[8]) {
  const pie_q4_0& b = row[k / 32];
  const float d = pie_half_bits(b.d);
  unsigned q[8];
  pie_nibbles8(b.qs, k % 32, q);
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = d * (static_cast<float>(q[e]) - 8.0f);
}

PIE_DEVICE float pie_load_at(const pie_q4_1* row, int k) {
  const pie_q4_1& b = row[k / 32];
  return pie_half_bits(b.d) * static_cast<float>(pie_nibble(b.qs, k % 32)) + pie_half_bits(b.m);
}

PIE_DEVICE void pie_load8_at(const pie_q4_1* row, int k, float (&out)[8]) {
  const pie_q4_1& b = row[k / 32];
  const float d = pie_half_bits(b.d), m = pie_half_bits(b.m);
  unsigned q[8];
  pie_nibbles8(b.qs, k % 32, q);
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = d * static_cast<float>(q[e]) + m;
}

PIE_DEVICE float pie_warp_sum(float v) {
  for (int mask = PIE_WARP / 2; mask > 0; mask >>= 1) v += pie_shfl_xor(v, mask);
  return v;
}

PIE_DEVICE float pie_warp_max(float v) {
  for (int mask = PIE_WARP / 2; mask > 0; mask >>= 1) v = fmaxf(v, pie_shfl_xor(v, mask));
  return v;
}

// Block-wide reductions; `scratch` holds one float per warp and every thread gets the result.
// The leading barrier lets consecutive reductions share one scratch array.
PIE_DEVICE float pie_block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % PIE_WARP, warp = threadIdx.x / PIE_WARP, warps = blockDim.x / PIE_WARP;
  v = pie_warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int i = 0; i < warps; ++i) total += scratch[i];
  return total;
}

PIE_DEVICE float pie_block_max(float v, float* scratch) {
  const int lane = threadIdx.x % PIE_WARP, warp = threadIdx.x / PIE_WARP, warps = blockDim.x / PIE_WARP;
  v = pie_warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float best = scratch[0];
  for (int i = 1; i < warps; ++i) best = fmaxf(best, scratch[i]);
  return best;
}

PIE_DEVICE float pie_silu(float x) { return x / (1.0f + expf(-x)); }

// 1 / rms of a row of `cols` values whose squares sum to `squares`: the RMSNorm factor, for the
// rms_norm kernel and the projections that fuse the norm alike.
PIE_DEVICE float pie_inv_rms(float squares, int cols, float eps) {
  return 1.0f / sqrtf(squares / static_cast<float>(cols) + eps);
}

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

// A weight row and its values: float types are plain arrays; GGML's block types (gguf.quants, whole
// blocks along a row) are arrays of blocks: 32 weights with an IEEE half scale first, or the K-quants'
// super-blocks of 256 in groups of 32 (Q6_K: 16) with their own scales. Rows and blocks are 2-byte
// aligned; `k` of pie_load8_at is a multiple of 8, so its 8 values share a block and a group.
struct pie_q8_0 { unsigned short d; signed char qs[32]; };                     // d * qs[j]
struct pie_q4_0 { unsigned short d; unsigned char qs[16]; };                   // d * (nibble - 8)
struct pie_q4_1 { unsigned short d, m; unsigned char qs[16]; };                // d * nibble + m
struct pie_q5_0 { unsigned short d; unsigned char qh[4]; unsigned char qs[16]; };  // d * ((nibble | bit j of qh << 4) - 16)
// Nibble j of a Q4/Q5 block: the low half of byte j for j < 16, the high half of byte j - 16 above.
// Q4_K/Q5_K, value e of 256 in group g = e / 32: d * sc[g] * q - dmin * m[g] (6-bit sc, m packed in
// `scales`); q is nibble l = e % 32 of the 32 bytes qs[32 * (g / 2)] (low half for even g), plus for
// Q5_K bit g of qh[l] as 16. Q6_K: d * scales[e / 16] * (q - 32), q 4 bits of ql and 2 of qh (below).
struct pie_q4_k { unsigned short d, dmin; unsigned char scales[12]; unsigned char qs[128]; };
struct pie_q5_k { unsigned short d, dmin; unsigned char scales[12]; unsigned char qh[32]; unsigned char qs[128]; };
struct pie_q6_k { unsigned char ql[128]; unsigned char qh[64]; signed char scales[16]; unsigned short d; };

template <typename W>
PIE_DEVICE const W* pie_row(const W* w, long long row, int cols) { return w + row * cols; }
template <int VALUES, typename Q>
PIE_DEVICE const Q* pie_block_row(const Q* w, long long row, int cols) { return w + row * (cols / VALUES); }
PIE_DEVICE const pie_q8_0* pie_row(const pie_q8_0* w, long long row, int cols) { return pie_block_row<32>(w, row, cols); }
PIE_DEVICE const pie_q4_0* pie_row(const pie_q4_0* w, long long row, int cols) { return pie_block_row<32>(w, row, cols); }
PIE_DEVICE const pie_q4_1* pie_row(const pie_q4_1* w, long long row, int cols) { return pie_block_row<32>(w, row, cols); }
PIE_DEVICE const pie_q5_0* pie_row(const pie_q5_0* w, long long row, int cols) { return pie_block_row<32>(w, row, cols); }
PIE_DEVICE const pie_q4_k* pie_row(const pie_q4_k* w, long long row, int cols) { return pie_block_row<256>(w, row, cols); }
PIE_DEVICE const pie_q5_k* pie_row(const pie_q5_k* w, long long row, int cols) { return pie_block_row<256>(w, row, cols); }
PIE_DEVICE const pie_q6_k* pie_row(const pie_q6_k* w, long long row, int cols) { return pie_block_row<256>(w, row, cols); }

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

PIE_DEVICE unsigned pie_q5_0_high(const pie_q5_0& b) {
  return b.qh[0] | (b.qh[1] << 8) | (b.qh[2] << 16) | (static_cast<unsigned>(b.qh[3]) << 24);
}

PIE_DEVICE float pie_load_at(const pie_q5_0* row, int k) {
  const pie_q5_0& b = row[k / 32];
  const int j = k % 32;
  const unsigned q = pie_nibble(b.qs, j) | (((pie_q5_0_high(b) >> j) & 1u) << 4);
  return pie_half_bits(b.d) * (static_cast<float>(q) - 16.0f);
}

PIE_DEVICE void pie_load8_at(const pie_q5_0* row, int k, float (&out)[8]) {
  const pie_q5_0& b = row[k / 32];
  const int j = k % 32;
  const float d = pie_half_bits(b.d);
  const unsigned high = pie_q5_0_high(b) >> j;
  unsigned q[8];
  pie_nibbles8(b.qs, j, q);
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = d * (static_cast<float>(q[e] | (((high >> e) & 1u) << 4)) - 16.0f);
}

// The scale and minimum of group g (0..7) of a Q4_K/Q5_K block, as floats d * sc and dmin * m.
PIE_DEVICE void pie_k_group(unsigned short d, unsigned short dmin, const unsigned char* s, int g, float& scale,
                            float& minimum) {
  unsigned sc, m;
  if (g < 4) {
    sc = s[g] & 63u;
    m = s[g + 4] & 63u;
  } else {
    sc = (s[g + 4] & 15u) | ((s[g - 4] >> 6) << 4);
    m = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
  }
  scale = pie_half_bits(d) * static_cast<float>(sc);
  minimum = pie_half_bits(dmin) * static_cast<float>(m);
}

// The low 4 bits of value e of a Q4_K/Q5_K block and, by pie_k_nibbles8, of values e .. e + 7.
PIE_DEVICE unsigned pie_k_nibble(const unsigned char* qs, int e) {
  return (qs[32 * (e / 64) + e % 32] >> (4 * ((e / 32) & 1))) & 15u;
}

PIE_DEVICE void pie_k_nibbles8(const unsigned char* qs, int e, unsigned (&out)[8]) {
  pie_load_bytes8(qs + 32 * (e / 64) + e % 32, out);
  const unsigned shift = 4u * ((e / 32) & 1);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = (out[i] >> shift) & 15u;
}

PIE_DEVICE float pie_load_at(const pie_q4_k* row, int k) {
  const pie_q4_k& b = row[k / 256];
  const int e = k % 256;
  float scale, minimum;
  pie_k_group(b.d, b.dmin, b.scales, e / 32, scale, minimum);
  return scale * static_cast<float>(pie_k_nibble(b.qs, e)) - minimum;
}

PIE_DEVICE void pie_load8_at(const pie_q4_k* row, int k, float (&out)[8]) {
  const pie_q4_k& b = row[k / 256];
  const int e = k % 256;
  float scale, minimum;
  pie_k_group(b.d, b.dmin, b.scales, e / 32, scale, minimum);
  unsigned q[8];
  pie_k_nibbles8(b.qs, e, q);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = scale * static_cast<float>(q[i]) - minimum;
}

PIE_DEVICE float pie_load_at(const pie_q5_k* row, int k) {
  const pie_q5_k& b = row[k / 256];
  const int e = k % 256, g = e / 32;
  float scale, minimum;
  pie_k_group(b.d, b.dmin, b.scales, g, scale, minimum);
  const unsigned q = pie_k_nibble(b.qs, e) | (((b.qh[e % 32] >> g) & 1u) << 4);
  return scale * static_cast<float>(q) - minimum;
}

PIE_DEVICE void pie_load8_at(const pie_q5_k* row, int k, float (&out)[8]) {
  const pie_q5_k& b = row[k / 256];
  const int e = k % 256, g = e / 32;
  float scale, minimum;
  pie_k_group(b.d, b.dmin, b.scales, g, scale, minimum);
  unsigned q[8], h[8];
  pie_k_nibbles8(b.qs, e, q);
  pie_load_bytes8(b.qh + e % 32, h);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = scale * static_cast<float>(q[i] | (((h[i] >> g) & 1u) << 4)) - minimum;
}

// Q6_K value e: in half n = e / 128 at p = e % 128, 4 bits of ql[64 n + p % 64] (the high half for
// p >= 64) and bits 2 (p / 32) .. +1 of qh[32 n + p % 32] above them.
PIE_DEVICE float pie_load_at(const pie_q6_k* row, int k) {
  const pie_q6_k& b = row[k / 256];
  const int e = k % 256, n = e / 128, p = e % 128;
  const unsigned low = (b.ql[64 * n + p % 64] >> (4 * (p / 64))) & 15u;
  const unsigned high = (b.qh[32 * n + p % 32] >> (2 * (p / 32))) & 3u;
  const float scale = pie_half_bits(b.d) * static_cast<float>(b.scales[e / 16]);
  return scale * static_cast<float>(static_cast<int>(low | (high << 4)) - 32);
}

PIE_DEVICE void pie_load8_at(const pie_q6_k* row, int k, float (&out)[8]) {
  const pie_q6_k& b = row[k / 256];
  const int e = k % 256, n = e / 128, p = e % 128;
  const float scale = pie_half_bits(b.d) * static_cast<float>(b.scales[e / 16]);
  unsigned low[8], high[8];
  pie_load_bytes8(b.ql + 64 * n + p % 64, low);
  pie_load_bytes8(b.qh + 32 * n + p % 32, high);
  const unsigned low_shift = 4u * (p / 64), high_shift = 2u * (p / 32);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const unsigned q = ((low[i] >> low_shift) & 15u) | (((high[i] >> high_shift) & 3u) << 4);
    out[i] = scale * static_cast<float>(static_cast<int>(q) - 32);
  }
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

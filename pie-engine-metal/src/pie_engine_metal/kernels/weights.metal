// Weights read as stored (pie.weights), shared by linear.metal and elementwise.metal: a weight
// buffer holds rows of `cols` values in one type, named by the code the kernel takes as a function
// constant, and every value is read as float. GGML's block types lie in whole blocks along a row;
// the first four hold 32 values a block, an IEEE half scale first:
//   Q8_0  34 bytes: d, 32 int8 q                 value d * q
//   Q4_0  18 bytes: d, 16 bytes of q             value d * (q - 8)
//   Q4_1  20 bytes: d, m, 16 bytes of q          value d * q + m
//   Q5_0  22 bytes: d, 4 bytes qh, 16 bytes of q value d * ((q | bit j of qh << 4) - 16)
// where nibble j of a Q4/Q5 block is the low half of byte j for j < 16, else the high half of byte j - 16.
// The K-quants hold 256 values a super-block; value e of Q4_K/Q5_K is in group g = e / 32:
//   Q4_K 144 bytes: d, dmin, 12 bytes of 6-bit scales and minima, 128 bytes of q
//   Q5_K 176 bytes: d, dmin, the same 12 bytes, 32 bytes qh, 128 bytes of q
//                   value d * sc[g] * q - dmin * m[g], q nibble e % 32 of the 32 bytes at 32 (g / 2) (the
//                   high half for odd g), for Q5_K plus 16 times bit g of qh[e % 32]
//   Q6_K 210 bytes: 128 bytes ql, 64 bytes qh, 16 int8 scales, d
//                   value d * scales[e / 16] * (q - 32), q (below) 4 bits of ql and 2 of qh
#include <metal_stdlib>
using namespace metal;

#define WEIGHT_F32 0u
#define WEIGHT_F16 1u
#define WEIGHT_BF16 2u
#define WEIGHT_Q8_0 3u
#define WEIGHT_Q4_0 4u
#define WEIGHT_Q4_1 5u
#define WEIGHT_Q5_0 6u
#define WEIGHT_Q4_K 7u
#define WEIGHT_Q5_K 8u
#define WEIGHT_Q6_K 9u

inline float half_at(device const uchar* p)
{
    return float(as_type<half>(ushort(uint(p[0]) | (uint(p[1]) << 8u))));
}

// Value k of a row of Q4_K, Q5_K or Q6_K.
inline float k_quant_value(device const uchar* weight, uint type, uint row, uint k, uint cols)
{
    uint block_bytes = type == WEIGHT_Q4_K ? 144u : (type == WEIGHT_Q5_K ? 176u : 210u);
    device const uchar* block = weight + (row * (cols / 256u) + k / 256u) * block_bytes;
    uint e = k % 256u;
    if (type == WEIGHT_Q6_K) {
        uint n = e / 128u, p = e % 128u;
        uint low = (uint(block[64u * n + p % 64u]) >> (4u * (p / 64u))) & 15u;
        uint high = (uint(block[128u + 32u * n + p % 32u]) >> (2u * (p / 32u))) & 3u;
        float scale = half_at(block + 208u) * float(int(uint(block[192u + e / 16u]) ^ 0x80u) - 128);
        return scale * float(int(low | (high << 4u)) - 32);
    }
    uint g = e / 32u;
    device const uchar* s = block + 4u;
    uint sc = g < 4u ? s[g] & 63u : (s[g + 4u] & 15u) | ((uint(s[g - 4u]) >> 6u) << 4u);
    uint m = g < 4u ? s[g + 4u] & 63u : (uint(s[g + 4u]) >> 4u) | ((uint(s[g]) >> 6u) << 4u);
    uint qs = type == WEIGHT_Q4_K ? 16u : 48u;
    uint q = (uint(block[qs + 32u * (g / 2u) + e % 32u]) >> (4u * (g % 2u))) & 15u;
    if (type == WEIGHT_Q5_K) {
        q |= ((uint(block[16u + e % 32u]) >> g) & 1u) << 4u;
    }
    return half_at(block) * float(sc) * float(q) - half_at(block + 2u) * float(m);
}

// Value k of row `row` of a weight of `cols` columns in type `type`.
inline float weight_value(device const uchar* weight, uint type, uint row, uint k, uint cols)
{
    uint at = row * cols + k;
    if (type == WEIGHT_F32) {
        return ((device const float*)weight)[at];
    }
    if (type == WEIGHT_F16) {
        return float(((device const half*)weight)[at]);
    }
    if (type == WEIGHT_BF16) {
        return as_type<float>(uint(((device const ushort*)weight)[at]) << 16u);
    }
    if (type >= WEIGHT_Q4_K) {
        return k_quant_value(weight, type, row, k, cols);
    }
    uint block_bytes = type == WEIGHT_Q8_0 ? 34u : (type == WEIGHT_Q4_0 ? 18u : (type == WEIGHT_Q4_1 ? 20u : 22u));
    device const uchar* block = weight + (row * (cols / 32u) + k / 32u) * block_bytes;
    float d = half_at(block);
    uint j = k % 32u;
    if (type == WEIGHT_Q8_0) {
        return d * float(int(uint(block[2u + j]) ^ 0x80u) - 128);
    }
    uint first = type == WEIGHT_Q4_0 ? 2u : (type == WEIGHT_Q4_1 ? 4u : 6u);
    uint q = (uint(block[first + j % 16u]) >> (j < 16u ? 0u : 4u)) & 15u;
    if (type == WEIGHT_Q5_0) {
        return d * (float(q | (((uint(block[2u + j / 8u]) >> (j % 8u)) & 1u) << 4u)) - 16.0f);
    }
    return type == WEIGHT_Q4_0 ? d * (float(q) - 8.0f) : d * float(q) + half_at(block + 2u);
}

// Values k .. k + 3 of a row (k a multiple of 4: they share a block).
inline float4 weight_values4(device const uchar* weight, uint type, uint row, uint k, uint cols)
{
    if (type == WEIGHT_F32) {
        return ((device const float4*)weight)[(row * cols + k) / 4u];
    }
    return float4(weight_value(weight, type, row, k, cols), weight_value(weight, type, row, k + 1u, cols),
                  weight_value(weight, type, row, k + 2u, cols), weight_value(weight, type, row, k + 3u, cols));
}

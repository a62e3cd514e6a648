// Weights read as stored (pie.weights), shared by linear.metal and elementwise.metal: a weight
// buffer holds rows of `cols` values in one type, named by the code the kernel takes as a function
// constant, and every value is read as float. GGML's block types hold 32 values a block, an IEEE
// half scale first, whole blocks along a row:
//   Q8_0  34 bytes: d, 32 int8 q          value d * q
//   Q4_0  18 bytes: d, 16 bytes of q      value d * (q - 8)
//   Q4_1  20 bytes: d, m, 16 bytes of q   value d * q + m
// where nibble j of a Q4 block is the low half of byte j for j < 16, else the high half of byte j - 16.
#include <metal_stdlib>
using namespace metal;

#define WEIGHT_F32 0u
#define WEIGHT_F16 1u
#define WEIGHT_BF16 2u
#define WEIGHT_Q8_0 3u
#define WEIGHT_Q4_0 4u
#define WEIGHT_Q4_1 5u

inline float half_at(device const uchar* p)
{
    return float(as_type<half>(ushort(uint(p[0]) | (uint(p[1]) << 8u))));
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
    uint block_bytes = type == WEIGHT_Q8_0 ? 34u : (type == WEIGHT_Q4_0 ? 18u : 20u);
    device const uchar* block = weight + (row * (cols / 32u) + k / 32u) * block_bytes;
    float d = half_at(block);
    uint j = k % 32u;
    if (type == WEIGHT_Q8_0) {
        return d * float(int(uint(block[2u + j]) ^ 0x80u) - 128);
    }
    uint first = type == WEIGHT_Q4_0 ? 2u : 4u;
    uint q = (uint(block[first + j % 16u]) >> (j < 16u ? 0u : 4u)) & 15u;
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

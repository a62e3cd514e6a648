// Projections y = x @ W.T, in three strategies with one epilogue:
//   linear_gemv       decode: one simdgroup per output feature, a few tokens at a time,
//                     lanes stride over K and meet in simd_sum (no threadgroup barriers);
//   linear_tiled      prefill: 32 x 32 output tiles through threadgroup memory;
//   linear_simdgroup  prefill on Apple7+ (M1 and later): the same tiles multiplied with
//                     8 x 8 simdgroup matrices.
//
// The weight is read as stored (weights.metal, prepended to this file): float32, half, bfloat16,
// Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K or Q6_K, named by the function constant weight_type; every
// sum is float.
//
// Function constants select the fused forms of the catalogue:
//   has_norm      x is RMS-normalised first: columns scaled by norm_weight[k] while loading,
//                 rows by inverse_rms[t] (from rows.metal's inverse_rms) in the epilogue;
//   has_bias      + bias[n];
//   gated         W stacks gate and up rows: y = silu(gate) * up, out_features = F;
//   has_residual  + residual[t, n].
// Unused inputs are bound to a small placeholder buffer and never read.
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
using namespace metal;

constant bool has_bias [[function_constant(0)]];
constant bool has_norm [[function_constant(1)]];
constant bool gated [[function_constant(2)]];
constant bool has_residual [[function_constant(3)]];
constant uint weight_type [[function_constant(4)]];

#define GEMV_TOKENS 4
#define TILE 32
#define TILE_K 16
#define TILED_SIDE 16
#define MM_THREADS 128

struct LinearParams {
    uint tokens;
    uint in_features;
    uint out_features;
};

inline float silu(float g)
{
    return g / (1.0f + exp(min(-g, 80.0f)));
}

// Output (t, n) from the raw dot products of its gate row (and up row when gated).
inline float epilogue(float gate, float up, uint t, uint n,
                      device const float* bias, device const float* inverse_rms,
                      device const float* residual, constant LinearParams& p)
{
    if (has_norm) {
        float s = inverse_rms[t];
        gate *= s;
        up *= s;
    }
    if (has_bias) {
        gate += bias[n];
        if (gated) {
            up += bias[p.out_features + n];
        }
    }
    float y = gated ? silu(gate) * up : gate;
    if (has_residual) {
        y += residual[t * p.out_features + n];
    }
    return y;
}

kernel void linear_gemv(
    device const float* x [[buffer(0)]],
    device const uchar* weight [[buffer(1)]],
    device const float* bias [[buffer(2)]],
    device const float* norm_weight [[buffer(3)]],
    device const float* inverse_rms [[buffer(4)]],
    device const float* residual [[buffer(5)]],
    device float* out [[buffer(6)]],
    constant LinearParams& p [[buffer(7)]],
    uint group [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]],
    uint width [[threads_per_simdgroup]])
{
    uint n = group * nsg + sg;
    if (n >= p.out_features) {
        return;  // the whole simdgroup leaves together; no barrier follows
    }
    uint k_count = p.in_features;
    uint up_n = p.out_features + n;
    bool vectorised = (k_count & 3u) == 0u;
    for (uint t0 = 0; t0 < p.tokens; t0 += GEMV_TOKENS) {
        uint count = min(uint(GEMV_TOKENS), p.tokens - t0);
        float acc_gate[GEMV_TOKENS] = {0.0f, 0.0f, 0.0f, 0.0f};
        float acc_up[GEMV_TOKENS] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (vectorised) {
            device const float4* norm4 = (device const float4*)norm_weight;
            for (uint k = lane; k < k_count / 4; k += width) {
                float4 g = weight_values4(weight, weight_type, n, 4u * k, k_count);
                float4 u = gated ? weight_values4(weight, weight_type, up_n, 4u * k, k_count) : float4(0.0f);
                if (has_norm) {
                    g *= norm4[k];
                    u *= norm4[k];
                }
                for (uint j = 0; j < GEMV_TOKENS; ++j) {
                    if (j < count) {
                        float4 xv = ((device const float4*)(x + (t0 + j) * k_count))[k];
                        acc_gate[j] += dot(g, xv);
                        acc_up[j] += dot(u, xv);
                    }
                }
            }
        } else {
            for (uint k = lane; k < k_count; k += width) {
                float g = weight_value(weight, weight_type, n, k, k_count);
                float u = gated ? weight_value(weight, weight_type, up_n, k, k_count) : 0.0f;
                if (has_norm) {
                    g *= norm_weight[k];
                    u *= norm_weight[k];
                }
                for (uint j = 0; j < GEMV_TOKENS; ++j) {
                    if (j < count) {
                        float xv = x[(t0 + j) * k_count + k];
                        acc_gate[j] += g * xv;
                        acc_up[j] += u * xv;
                    }
                }
            }
        }
        for (uint j = 0; j < count; ++j) {
            float gate = simd_sum(acc_gate[j]);
            float up = gated ? simd_sum(acc_up[j]) : 0.0f;
            if (lane == 0) {
                uint t = t0 + j;
                out[t * p.out_features + n] = epilogue(gate, up, t, n, bias, inverse_rms, residual, p);
            }
        }
    }
}

// One 32 x 32 output tile per threadgroup of 16 x 16 threads; each thread owns the
// outputs (local.y + 16 i, local.x + 16 j) for i, j in {0, 1}.
kernel void linear_tiled(
    device const float* x [[buffer(0)]],
    device const uchar* weight [[buffer(1)]],
    device const float* bias [[buffer(2)]],
    device const float* norm_weight [[buffer(3)]],
    device const float* inverse_rms [[buffer(4)]],
    device const float* residual [[buffer(5)]],
    device float* out [[buffer(6)]],
    constant LinearParams& p [[buffer(7)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint2 local [[thread_position_in_threadgroup]])
{
    threadgroup float xs[TILE][TILE_K];
    threadgroup float gate_tile[TILE][TILE_K + 1];
    threadgroup float up_tile[TILE][TILE_K + 1];
    uint k_count = p.in_features;
    uint t_base = group.y * TILE;
    uint n_base = group.x * TILE;
    uint tid = local.y * TILED_SIDE + local.x;
    float acc_gate[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
    float acc_up[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
    for (uint k0 = 0; k0 < k_count; k0 += TILE_K) {
        for (uint e = tid; e < TILE * TILE_K; e += TILED_SIDE * TILED_SIDE) {
            uint r = e / TILE_K;
            uint c = e % TILE_K;
            uint k = k0 + c;
            uint t = t_base + r;
            uint n = n_base + r;
            float xv = 0.0f;
            if (t < p.tokens && k < k_count) {
                xv = x[t * k_count + k];
                if (has_norm) {
                    xv *= norm_weight[k];
                }
            }
            xs[r][c] = xv;
            float g = 0.0f;
            float u = 0.0f;
            if (n < p.out_features && k < k_count) {
                g = weight_value(weight, weight_type, n, k, k_count);
                if (gated) {
                    u = weight_value(weight, weight_type, p.out_features + n, k, k_count);
                }
            }
            gate_tile[r][c] = g;
            up_tile[r][c] = u;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint c = 0; c < TILE_K; ++c) {
            float x0 = xs[local.y][c];
            float x1 = xs[local.y + TILED_SIDE][c];
            float g0 = gate_tile[local.x][c];
            float g1 = gate_tile[local.x + TILED_SIDE][c];
            acc_gate[0][0] += x0 * g0;
            acc_gate[0][1] += x0 * g1;
            acc_gate[1][0] += x1 * g0;
            acc_gate[1][1] += x1 * g1;
            if (gated) {
                float u0 = up_tile[local.x][c];
                float u1 = up_tile[local.x + TILED_SIDE][c];
                acc_up[0][0] += x0 * u0;
                acc_up[0][1] += x0 * u1;
                acc_up[1][0] += x1 * u0;
                acc_up[1][1] += x1 * u1;
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    for (uint i = 0; i < 2; ++i) {
        for (uint j = 0; j < 2; ++j) {
            uint t = t_base + local.y + i * TILED_SIDE;
            uint n = n_base + local.x + j * TILED_SIDE;
            if (t < p.tokens && n < p.out_features) {
                out[t * p.out_features + n] =
                    epilogue(acc_gate[i][j], acc_up[i][j], t, n, bias, inverse_rms, residual, p);
            }
        }
    }
}

// The 32 x 32 tile again, as four simdgroups (128 threads, 32 lanes each) that each own
// a 16 x 16 quarter: 2 x 2 accumulators of 8 x 8. W rows are loaded transposed, which
// turns the tile of W (n by k) into the k by n right-hand operand.
kernel void linear_simdgroup(
    device const float* x [[buffer(0)]],
    device const uchar* weight [[buffer(1)]],
    device const float* bias [[buffer(2)]],
    device const float* norm_weight [[buffer(3)]],
    device const float* inverse_rms [[buffer(4)]],
    device const float* residual [[buffer(5)]],
    device float* out [[buffer(6)]],
    constant LinearParams& p [[buffer(7)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]])
{
    threadgroup float xs[TILE * TILE_K];
    threadgroup float gate_tile[TILE * TILE_K];
    threadgroup float up_tile[TILE * TILE_K];
    threadgroup float gate_out[TILE * TILE];
    threadgroup float up_out[TILE * TILE];
    uint k_count = p.in_features;
    uint t_base = group.y * TILE;
    uint n_base = group.x * TILE;
    uint quarter_row = (sg / 2) * 16;
    uint quarter_col = (sg % 2) * 16;
    simdgroup_float8x8 acc_gate[2][2];
    simdgroup_float8x8 acc_up[2][2];
    for (uint i = 0; i < 2; ++i) {
        for (uint j = 0; j < 2; ++j) {
            acc_gate[i][j] = make_filled_simdgroup_matrix<float, 8>(0.0f);
            acc_up[i][j] = make_filled_simdgroup_matrix<float, 8>(0.0f);
        }
    }
    for (uint k0 = 0; k0 < k_count; k0 += TILE_K) {
        for (uint e = tid; e < TILE * TILE_K; e += MM_THREADS) {
            uint r = e / TILE_K;
            uint k = k0 + e % TILE_K;
            uint t = t_base + r;
            uint n = n_base + r;
            float xv = 0.0f;
            if (t < p.tokens && k < k_count) {
                xv = x[t * k_count + k];
                if (has_norm) {
                    xv *= norm_weight[k];
                }
            }
            xs[e] = xv;
            float g = 0.0f;
            float u = 0.0f;
            if (n < p.out_features && k < k_count) {
                g = weight_value(weight, weight_type, n, k, k_count);
                if (gated) {
                    u = weight_value(weight, weight_type, p.out_features + n, k, k_count);
                }
            }
            gate_tile[e] = g;
            up_tile[e] = u;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint kk = 0; kk < TILE_K; kk += 8) {
            simdgroup_float8x8 a[2];
            simdgroup_float8x8 b_gate[2];
            simdgroup_float8x8 b_up[2];
            for (uint i = 0; i < 2; ++i) {
                simdgroup_load(a[i], xs + (quarter_row + 8 * i) * TILE_K + kk, TILE_K);
            }
            for (uint j = 0; j < 2; ++j) {
                simdgroup_load(b_gate[j], gate_tile + (quarter_col + 8 * j) * TILE_K + kk, TILE_K, ulong2(0, 0), true);
                if (gated) {
                    simdgroup_load(b_up[j], up_tile + (quarter_col + 8 * j) * TILE_K + kk, TILE_K, ulong2(0, 0), true);
                }
            }
            for (uint i = 0; i < 2; ++i) {
                for (uint j = 0; j < 2; ++j) {
                    simdgroup_multiply_accumulate(acc_gate[i][j], a[i], b_gate[j], acc_gate[i][j]);
                    if (gated) {
                        simdgroup_multiply_accumulate(acc_up[i][j], a[i], b_up[j], acc_up[i][j]);
                    }
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    for (uint i = 0; i < 2; ++i) {
        for (uint j = 0; j < 2; ++j) {
            uint at = (quarter_row + 8 * i) * TILE + quarter_col + 8 * j;
            simdgroup_store(acc_gate[i][j], gate_out + at, TILE);
            if (gated) {
                simdgroup_store(acc_up[i][j], up_out + at, TILE);
            }
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint e = tid; e < TILE * TILE; e += MM_THREADS) {
        uint t = t_base + e / TILE;
        uint n = n_base + e % TILE;
        if (t < p.tokens && n < p.out_features) {
            float up = gated ? up_out[e] : 0.0f;
            out[t * p.out_features + n] = epilogue(gate_out[e], up, t, n, bias, inverse_rms, residual, p);
        }
    }
}

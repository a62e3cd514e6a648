// Row reductions: one threadgroup per row (rms_norm, softmax, argmax, and the
// inverse-RMS prologue of the fused norm + projection kernels).
//
// Each thread strides over its row, each simdgroup reduces in registers, and the
// simdgroup partials meet in threadgroup memory. Nothing assumes a simdgroup width:
// the same code runs with 32 lanes (Apple GPUs) or 8 to 64 (Intel and AMD Macs).
#include <metal_stdlib>
using namespace metal;

#define MAX_SIMDGROUPS 32

constant float eps [[function_constant(0)]];
constant float temperature [[function_constant(1)]];

struct RowParams {
    uint rows;
    uint cols;
};

// Every thread gets the same total: partials are added in simdgroup order.
inline float group_sum(float v, threadgroup float* partial, uint lane, uint sg, uint nsg)
{
    v = simd_sum(v);
    if (lane == 0) {
        partial[sg] = v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total = 0.0f;
    for (uint i = 0; i < nsg; ++i) {
        total += partial[i];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    return total;
}

inline float group_max(float v, threadgroup float* partial, uint lane, uint sg, uint nsg)
{
    v = simd_max(v);
    if (lane == 0) {
        partial[sg] = v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float best = -INFINITY;
    for (uint i = 0; i < nsg; ++i) {
        best = max(best, partial[i]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    return best;
}

inline uint group_min(uint v, threadgroup uint* partial, uint lane, uint sg, uint nsg)
{
    v = simd_min(v);
    if (lane == 0) {
        partial[sg] = v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    uint least = UINT_MAX;
    for (uint i = 0; i < nsg; ++i) {
        least = min(least, partial[i]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    return least;
}

inline float row_inverse_rms(device const float* xr, uint cols, threadgroup float* partial,
                             uint tid, uint ntg, uint lane, uint sg, uint nsg)
{
    float squares = 0.0f;
    for (uint i = tid; i < cols; i += ntg) {
        float v = xr[i];
        squares += v * v;
    }
    float total = group_sum(squares, partial, lane, sg, nsg);
    return rsqrt(total / float(cols) + eps);
}

// out = x / sqrt(mean(x^2) + eps) * weight
kernel void rms_norm(
    device const float* x [[buffer(0)]],
    device const float* weight [[buffer(1)]],
    device float* out [[buffer(2)]],
    constant RowParams& p [[buffer(3)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint ntg [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]])
{
    threadgroup float partial[MAX_SIMDGROUPS];
    device const float* xr = x + row * p.cols;
    float scale = row_inverse_rms(xr, p.cols, partial, tid, ntg, lane, sg, nsg);
    device float* yr = out + row * p.cols;
    for (uint i = tid; i < p.cols; i += ntg) {
        yr[i] = xr[i] * scale * weight[i];
    }
}

// out[row] = 1 / sqrt(mean(x[row]^2) + eps): the prologue of the fused projections.
kernel void inverse_rms(
    device const float* x [[buffer(0)]],
    device float* out [[buffer(1)]],
    constant RowParams& p [[buffer(2)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint ntg [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]])
{
    threadgroup float partial[MAX_SIMDGROUPS];
    float scale = row_inverse_rms(x + row * p.cols, p.cols, partial, tid, ntg, lane, sg, nsg);
    if (tid == 0) {
        out[row] = scale;
    }
}

// out = softmax(x / temperature) along each row.
kernel void softmax(
    device const float* x [[buffer(0)]],
    device float* out [[buffer(1)]],
    constant RowParams& p [[buffer(2)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint ntg [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]])
{
    threadgroup float partial[MAX_SIMDGROUPS];
    device const float* xr = x + row * p.cols;
    device float* yr = out + row * p.cols;
    float local_max = -INFINITY;
    for (uint i = tid; i < p.cols; i += ntg) {
        local_max = max(local_max, xr[i] / temperature);
    }
    float row_max = group_max(local_max, partial, lane, sg, nsg);
    float local_sum = 0.0f;
    for (uint i = tid; i < p.cols; i += ntg) {
        float e = exp(xr[i] / temperature - row_max);
        yr[i] = e;
        local_sum += e;
    }
    float inverse = 1.0f / group_sum(local_sum, partial, lane, sg, nsg);
    for (uint i = tid; i < p.cols; i += ntg) {
        yr[i] *= inverse;
    }
}

// out[row] = index of the row's maximum, the first one on ties.
kernel void argmax(
    device const float* x [[buffer(0)]],
    device int* out [[buffer(1)]],
    constant RowParams& p [[buffer(2)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint ntg [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]])
{
    threadgroup float partial_max[MAX_SIMDGROUPS];
    threadgroup uint partial_index[MAX_SIMDGROUPS];
    device const float* xr = x + row * p.cols;
    float best = -INFINITY;
    uint best_index = UINT_MAX;
    // Each thread visits increasing indices, so a strict `>` keeps its first maximum.
    for (uint i = tid; i < p.cols; i += ntg) {
        float v = xr[i];
        if (best_index == UINT_MAX || v > best) {
            best = v;
            best_index = i;
        }
    }
    float row_max = group_max(best, partial_max, lane, sg, nsg);
    uint candidate = (best_index != UINT_MAX && best == row_max) ? best_index : UINT_MAX;
    uint first = group_min(candidate, partial_index, lane, sg, nsg);
    if (tid == 0) {
        out[row] = int(first);
    }
}

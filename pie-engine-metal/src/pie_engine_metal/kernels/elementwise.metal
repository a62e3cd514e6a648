// Elementwise and data-movement kernels: one thread per output element, no barriers.
//
// Every kernel is dispatched as whole threadgroups, so each thread checks its own
// bounds first. Shapes arrive in a small `constant` struct bound right after the
// buffers; options fixed at compile time are function constants. The embedding table is read as
// stored (weights.metal, prepended to this file), in the type named by table_type.
#include <metal_stdlib>
using namespace metal;

constant uint slice_start [[function_constant(0)]];
constant uint rope_head_dim [[function_constant(1)]];
constant uint table_type [[function_constant(2)]];

struct EmbeddingParams {
    uint tokens;
    uint dim;
    uint vocab;
};

struct CountParams {
    uint count;
};

struct SliceParams {
    uint rows;
    uint in_cols;
    uint out_cols;
};

struct SiluMulParams {
    uint rows;
    uint cols;
};

struct RopeParams {
    uint tokens;
    uint heads;
};

struct AppendKvParams {
    uint tokens;
    uint width;
    uint page_size;
    uint num_pages;
};

struct GatherParams {
    uint rows;
    uint cols;
    uint source_rows;
};

// out[t, d] = table[ids[t], d]; an id outside the table gives a zero row.
kernel void embedding(
    device const int* ids [[buffer(0)]],
    device const uchar* table [[buffer(1)]],
    device float* out [[buffer(2)]],
    constant EmbeddingParams& p [[buffer(3)]],
    uint2 gid [[thread_position_in_grid]])
{
    if (gid.x >= p.dim || gid.y >= p.tokens) {
        return;
    }
    uint row = uint(ids[gid.y]);
    out[gid.y * p.dim + gid.x] = row < p.vocab ? weight_value(table, table_type, row, gid.x, p.dim) : 0.0f;
}

kernel void add(
    device const float* a [[buffer(0)]],
    device const float* b [[buffer(1)]],
    device float* out [[buffer(2)]],
    constant CountParams& p [[buffer(3)]],
    uint gid [[thread_position_in_grid]])
{
    if (gid < p.count) {
        out[gid] = a[gid] + b[gid];
    }
}

// out[t, c] = x[t, slice_start + c]
kernel void slice_columns(
    device const float* x [[buffer(0)]],
    device float* out [[buffer(1)]],
    constant SliceParams& p [[buffer(2)]],
    uint2 gid [[thread_position_in_grid]])
{
    if (gid.x >= p.out_cols || gid.y >= p.rows) {
        return;
    }
    out[gid.y * p.out_cols + gid.x] = x[gid.y * p.in_cols + slice_start + gid.x];
}

inline float silu(float g)
{
    // exp(-g) overflows for g < -88; clamping keeps the result a tiny negative number.
    return g / (1.0f + exp(min(-g, 80.0f)));
}

// out[t, f] = silu(gate_up[t, f]) * gate_up[t, cols + f]
kernel void silu_mul(
    device const float* gate_up [[buffer(0)]],
    device float* out [[buffer(1)]],
    constant SiluMulParams& p [[buffer(2)]],
    uint2 gid [[thread_position_in_grid]])
{
    if (gid.x >= p.cols || gid.y >= p.rows) {
        return;
    }
    device const float* row = gate_up + gid.y * 2 * p.cols;
    out[gid.y * p.cols + gid.x] = silu(row[gid.x]) * row[p.cols + gid.x];
}

// Rotate-half rotary embedding: thread (i, head, token) rotates the pair (i, i + head_dim / 2).
// The angle is rounded to float before cos/sin, as transformers computes it.
kernel void rope(
    device const float* x [[buffer(0)]],
    device const int* positions [[buffer(1)]],
    device const float* inv_freq [[buffer(2)]],
    device float* out [[buffer(3)]],
    constant RopeParams& p [[buffer(4)]],
    uint3 gid [[thread_position_in_grid]])
{
    uint half_dim = rope_head_dim / 2;
    if (gid.x >= half_dim || gid.y >= p.heads || gid.z >= p.tokens) {
        return;
    }
    float angle = float(positions[gid.z]) * inv_freq[gid.x];
    float c = precise::cos(angle);
    float s = precise::sin(angle);
    uint base = (gid.z * p.heads + gid.y) * rope_head_dim;
    float first = x[base + gid.x];
    float second = x[base + half_dim + gid.x];
    out[base + gid.x] = first * c - second * s;
    out[base + half_dim + gid.x] = second * c + first * s;
}

// Write token t's K and V rows into the page pool at flat slot page * page_size + offset.
// `pool` is bound at the layer's offset: [num_pages, 2, page_size, width].
kernel void append_kv(
    device float* pool [[buffer(0)]],
    device const float* k [[buffer(1)]],
    device const float* v [[buffer(2)]],
    device const int* slots [[buffer(3)]],
    constant AppendKvParams& p [[buffer(4)]],
    uint2 gid [[thread_position_in_grid]])
{
    if (gid.x >= p.width || gid.y >= p.tokens) {
        return;
    }
    uint slot = uint(slots[gid.y]);
    uint page = slot / p.page_size;
    if (page >= p.num_pages) {
        return;
    }
    uint offset = slot - page * p.page_size;
    uint key_at = ((page * 2 + 0) * p.page_size + offset) * p.width + gid.x;
    uint value_at = ((page * 2 + 1) * p.page_size + offset) * p.width + gid.x;
    pool[key_at] = k[gid.y * p.width + gid.x];
    pool[value_at] = v[gid.y * p.width + gid.x];
}

// out[b, d] = x[rows[b], d]; a row outside x gives zeros.
kernel void gather_rows(
    device const float* x [[buffer(0)]],
    device const int* rows [[buffer(1)]],
    device float* out [[buffer(2)]],
    constant GatherParams& p [[buffer(3)]],
    uint2 gid [[thread_position_in_grid]])
{
    if (gid.x >= p.cols || gid.y >= p.rows) {
        return;
    }
    uint source = uint(rows[gid.y]);
    out[gid.y * p.cols + gid.x] = source < p.source_rows ? x[source * p.cols + gid.x] : 0.0f;
}

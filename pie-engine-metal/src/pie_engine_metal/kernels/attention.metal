// Causal paged attention over FlashInfer-style page tables, with grouped KV heads.
//
// Sequence b owns query rows qo_indptr[b] .. qo_indptr[b + 1] and the KV pages
// kv_page_indices[kv_page_indptr[b] .. kv_page_indptr[b + 1]]; its last page holds
// kv_last_page_lens[b] tokens. New tokens are the last of their sequence, so query i
// of a sequence with q_len new tokens and kv_len cached ones sees kv_len - q_len + i + 1 keys,
// with a sliding window (window > 0) only the last `window` of them; with softcap > 0 each
// score s becomes softcap * tanh(s / softcap). Both are function constants: at 0 the compiler
// removes them.
// `pool` is bound at the layer's offset: [num_pages, 2, page_size, num_kv_heads, head_dim].
//
// Both kernels use online softmax with lane-per-key scores: a simdgroup scores as
// many keys as it has lanes, then every lane accumulates its own head dimensions
// (d = lane, lane + width, ...), so head_dim <= DIMS_PER_LANE * width.
//   attention_decode   one threadgroup per (query head, token); its simdgroups split
//                      the keys and merge their partial softmax states at the end;
//   attention_prefill  one threadgroup per (query head, block of tokens), a simdgroup
//                      per token; tiles of keys are staged once in threadgroup memory
//                      and shared by every token of the block in the same sequence.
#include <metal_stdlib>
using namespace metal;

#define DIMS_PER_LANE 8
#define MAX_HEAD_DIM 256
#define MAX_WIDTH 64
#define DECODE_MAX_SIMDGROUPS 16
#define PREFILL_MAX_HEAD_DIM 128
#define PREFILL_KEYS 32
#define PREFILL_MAX_QUERIES 8

constant float scale [[function_constant(0)]];
constant uint window [[function_constant(1)]];
constant float softcap [[function_constant(2)]];

struct AttentionParams {
    uint tokens;
    uint num_seqs;
    uint num_heads;
    uint num_kv_heads;
    uint head_dim;
    uint page_size;
    uint num_pages;
};

struct Span {
    uint q_start;
    uint q_len;
    uint kv_len;
    uint first_page;
};

// The sequence that owns query row t: the last b with qo_indptr[b] <= t.
inline uint sequence_of(device const int* qo_indptr, uint num_seqs, uint t)
{
    uint lo = 0;
    uint hi = num_seqs;
    while (hi - lo > 1) {
        uint mid = (lo + hi) / 2;
        if (uint(qo_indptr[mid]) <= t) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return lo;
}

inline Span span_of(uint b, device const int* qo_indptr, device const int* kv_page_indptr,
                    device const int* kv_last_page_lens, uint page_size)
{
    Span s;
    s.q_start = uint(qo_indptr[b]);
    s.q_len = uint(qo_indptr[b + 1]) - s.q_start;
    s.first_page = uint(kv_page_indptr[b]);
    uint pages = uint(kv_page_indptr[b + 1]) - s.first_page;
    s.kv_len = pages == 0 ? 0 : (pages - 1) * page_size + uint(kv_last_page_lens[b]);
    return s;
}

// The first key a query that sees `visible` keys attends to: its window's first, 0 without a window.
inline uint window_start(uint visible)
{
    return window > 0 && visible > window ? visible - window : 0;
}

inline float capped(float score)
{
    return softcap > 0.0f ? softcap * tanh(score / softcap) : score;
}

// Key (which = 0) or value (which = 1) row j of a sequence for one KV head.
inline device const float* kv_row(device const float* pool, device const int* kv_page_indices, Span s,
                                  uint j, uint which, uint kv_head, constant AttentionParams& p)
{
    uint page = min(uint(kv_page_indices[s.first_page + j / p.page_size]), p.num_pages - 1);
    uint offset = j % p.page_size;
    return pool + (((page * 2 + which) * p.page_size + offset) * p.num_kv_heads + kv_head) * p.head_dim;
}

kernel void attention_decode(
    device const float* q [[buffer(0)]],
    device const float* pool [[buffer(1)]],
    device const int* qo_indptr [[buffer(2)]],
    device const int* kv_page_indices [[buffer(3)]],
    device const int* kv_page_indptr [[buffer(4)]],
    device const int* kv_last_page_lens [[buffer(5)]],
    device float* out [[buffer(6)]],
    constant AttentionParams& p [[buffer(7)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint2 threads [[threads_per_threadgroup]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]],
    uint width [[threads_per_simdgroup]])
{
    threadgroup float query[MAX_HEAD_DIM];
    threadgroup float probs[DECODE_MAX_SIMDGROUPS][MAX_WIDTH];
    threadgroup float maxes[DECODE_MAX_SIMDGROUPS];
    threadgroup float sums[DECODE_MAX_SIMDGROUPS];
    threadgroup float partial_out[DECODE_MAX_SIMDGROUPS][MAX_HEAD_DIM];
    uint head = group.x;
    uint t = group.y;
    uint head_dim = p.head_dim;
    uint kv_head = head / (p.num_heads / p.num_kv_heads);
    Span s = span_of(sequence_of(qo_indptr, p.num_seqs, t), qo_indptr, kv_page_indptr, kv_last_page_lens, p.page_size);
    uint visible = s.kv_len - s.q_len + (t - s.q_start) + 1;

    device const float* q_row = q + (t * p.num_heads + head) * head_dim;
    for (uint d = tid; d < head_dim; d += threads.x) {
        query[d] = q_row[d] * scale;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    float running_max = -FLT_MAX;
    float running_sum = 0.0f;
    float acc[DIMS_PER_LANE] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (uint chunk = window_start(visible) + sg * width; chunk < visible; chunk += nsg * width) {
        uint j = chunk + lane;
        float score = -FLT_MAX;
        if (j < visible) {
            device const float* key = kv_row(pool, kv_page_indices, s, j, 0, kv_head, p);
            score = 0.0f;
            for (uint d = 0; d < head_dim; ++d) {
                score += query[d] * key[d];
            }
            score = capped(score);
        }
        float new_max = max(running_max, simd_max(score));
        float prob = j < visible ? exp(score - new_max) : 0.0f;
        float correction = exp(running_max - new_max);
        running_sum = running_sum * correction + simd_sum(prob);
        running_max = new_max;
        for (uint r = 0; r < DIMS_PER_LANE; ++r) {
            acc[r] *= correction;
        }
        probs[sg][lane] = prob;
        simdgroup_barrier(mem_flags::mem_threadgroup);
        uint keys = min(width, visible - chunk);
        for (uint i = 0; i < keys; ++i) {
            float w = probs[sg][i];
            device const float* value = kv_row(pool, kv_page_indices, s, chunk + i, 1, kv_head, p);
            for (uint r = 0; r < DIMS_PER_LANE; ++r) {
                uint d = lane + r * width;
                if (d < head_dim) {
                    acc[r] += w * value[d];
                }
            }
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);
    }

    if (lane == 0) {
        maxes[sg] = running_max;
        sums[sg] = running_sum;
    }
    for (uint r = 0; r < DIMS_PER_LANE; ++r) {
        uint d = lane + r * width;
        if (d < head_dim) {
            partial_out[sg][d] = acc[r];
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total_max = -FLT_MAX;
    for (uint i = 0; i < nsg; ++i) {
        total_max = max(total_max, maxes[i]);
    }
    float total = 0.0f;
    for (uint i = 0; i < nsg; ++i) {
        total += sums[i] * exp(maxes[i] - total_max);
    }
    device float* out_row = out + (t * p.num_heads + head) * head_dim;
    for (uint d = tid; d < head_dim; d += threads.x) {
        float o = 0.0f;
        for (uint i = 0; i < nsg; ++i) {
            o += partial_out[i][d] * exp(maxes[i] - total_max);
        }
        out_row[d] = o / total;
    }
}

kernel void attention_prefill(
    device const float* q [[buffer(0)]],
    device const float* pool [[buffer(1)]],
    device const int* qo_indptr [[buffer(2)]],
    device const int* kv_page_indices [[buffer(3)]],
    device const int* kv_page_indptr [[buffer(4)]],
    device const int* kv_last_page_lens [[buffer(5)]],
    device float* out [[buffer(6)]],
    constant AttentionParams& p [[buffer(7)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint2 threads [[threads_per_threadgroup]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]],
    uint width [[threads_per_simdgroup]])
{
    threadgroup float queries[PREFILL_MAX_QUERIES][PREFILL_MAX_HEAD_DIM];
    threadgroup float keys[PREFILL_KEYS][PREFILL_MAX_HEAD_DIM + 1];
    threadgroup float probs[PREFILL_MAX_QUERIES][PREFILL_KEYS];
    uint head = group.x;
    uint first_token = group.y * nsg;
    uint last_token = min(first_token + nsg, p.tokens) - 1;
    uint t = first_token + sg;
    bool active = t < p.tokens;
    uint head_dim = p.head_dim;
    uint kv_head = head / (p.num_heads / p.num_kv_heads);

    for (uint e = tid; e < nsg * head_dim; e += threads.x) {
        uint row = e / head_dim;
        uint token = first_token + row;
        queries[row][e % head_dim] = token < p.tokens ? q[(token * p.num_heads + head) * head_dim + e % head_dim] * scale : 0.0f;
    }

    uint mine = active ? sequence_of(qo_indptr, p.num_seqs, t) : UINT_MAX;
    float running_max = -FLT_MAX;
    float running_sum = 0.0f;
    float acc[DIMS_PER_LANE] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    uint b_last = sequence_of(qo_indptr, p.num_seqs, last_token);
    // Every loop bound below is the same for the whole threadgroup, so all threads meet every barrier.
    for (uint b = sequence_of(qo_indptr, p.num_seqs, first_token); b <= b_last; ++b) {
        Span s = span_of(b, qo_indptr, kv_page_indptr, kv_last_page_lens, p.page_size);
        if (s.q_len == 0) {
            continue;
        }
        uint block_end = min(first_token + nsg, s.q_start + s.q_len);
        uint reach = s.kv_len - s.q_len + (block_end - s.q_start);
        uint visible = mine == b ? s.kv_len - s.q_len + (t - s.q_start) + 1 : 0;
        uint seen = window_start(visible);  // this simdgroup's token's first key
        uint block_first = max(first_token, s.q_start);  // the block's first token of this sequence
        for (uint k0 = window_start(s.kv_len - s.q_len + (block_first - s.q_start) + 1); k0 < reach; k0 += PREFILL_KEYS) {
            uint tile = min(uint(PREFILL_KEYS), reach - k0);
            threadgroup_barrier(mem_flags::mem_threadgroup);
            for (uint e = tid; e < tile * head_dim; e += threads.x) {
                uint r = e / head_dim;
                keys[r][e % head_dim] = kv_row(pool, kv_page_indices, s, k0 + r, 0, kv_head, p)[e % head_dim];
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
            if (k0 >= visible) {
                continue;  // uniform within the simdgroup: its one token sees no key of this tile
            }
            uint count = min(tile, visible - k0);
            uint skip = seen > k0 ? min(seen - k0, count) : 0;  // keys of the tile before the window
            if (skip == count) {
                continue;  // uniform within the simdgroup, like the test above
            }
            float local_max = -FLT_MAX;
            for (uint i = skip + lane; i < count; i += width) {
                float score = 0.0f;
                for (uint d = 0; d < head_dim; ++d) {
                    score += queries[sg][d] * keys[i][d];
                }
                score = capped(score);
                probs[sg][i] = score;
                local_max = max(local_max, score);
            }
            float new_max = max(running_max, simd_max(local_max));
            float correction = exp(running_max - new_max);
            float local_sum = 0.0f;
            for (uint i = skip + lane; i < count; i += width) {
                float e = exp(probs[sg][i] - new_max);
                probs[sg][i] = e;
                local_sum += e;
            }
            running_sum = running_sum * correction + simd_sum(local_sum);
            running_max = new_max;
            for (uint r = 0; r < DIMS_PER_LANE; ++r) {
                acc[r] *= correction;
            }
            simdgroup_barrier(mem_flags::mem_threadgroup);
            for (uint i = skip; i < count; ++i) {
                float w = probs[sg][i];
                device const float* value = kv_row(pool, kv_page_indices, s, k0 + i, 1, kv_head, p);
                for (uint r = 0; r < DIMS_PER_LANE; ++r) {
                    uint d = lane + r * width;
                    if (d < head_dim) {
                        acc[r] += w * value[d];
                    }
                }
            }
            simdgroup_barrier(mem_flags::mem_threadgroup);
        }
    }
    if (!active) {
        return;
    }
    device float* out_row = out + (t * p.num_heads + head) * head_dim;
    for (uint r = 0; r < DIMS_PER_LANE; ++r) {
        uint d = lane + r * width;
        if (d < head_dim) {
            out_row[d] = acc[r] / running_sum;
        }
    }
}

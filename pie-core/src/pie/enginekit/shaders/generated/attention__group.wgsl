
fn _slang_getInfinity(positive: bool) -> f32
{
    let a = select(f32(-1.0), f32(1.0), positive);
    let b = f32(0.0);
    return a / b;
}

@binding(2) @group(0) var<storage, read> pool_0 : array<f32>;

struct AttentionParams_std140_0
{
    @align(16) tokens_0 : u32,
    @align(4) batch_0 : u32,
    @align(8) num_heads_0 : u32,
    @align(4) kv_heads_0 : u32,
    @align(16) head_dim_0 : u32,
    @align(4) page_size_0 : u32,
    @align(8) layer_base_0 : u32,
    @align(4) scale_0 : f32,
    @align(16) window_0 : u32,
    @align(4) softcap_0 : f32,
    @align(8) key_begin_0 : u32,
    @align(4) key_count_0 : u32,
    @align(16) resume_0 : u32,
    @align(4) finish_0 : u32,
};

@binding(0) @group(0) var<uniform> params_0 : AttentionParams_std140_0;
@binding(3) @group(0) var<storage, read> qo_indptr_0 : array<i32>;

@binding(5) @group(0) var<storage, read> kv_page_indptr_0 : array<i32>;

@binding(6) @group(0) var<storage, read> kv_last_page_lens_0 : array<i32>;

@binding(1) @group(0) var<storage, read> q_0 : array<f32>;

@binding(12) @group(0) var<storage, read_write> state_0 : array<f32>;

@binding(7) @group(0) var<storage, read_write> result_0 : array<f32>;

@binding(4) @group(0) var<storage, read> kv_page_indices_0 : array<i32>;

struct Sequence_0
{
     first_key_0 : u32,
     visible_0 : u32,
     first_page_0 : u32,
};

fn find_sequence_0( token_0 : u32) -> Sequence_0
{
    var high_0 : u32 = params_0.batch_0;
    var low_0 : u32 = u32(0);
    for(;;)
    {
        if((high_0 - low_0) > u32(1))
        {
        }
        else
        {
            break;
        }
        var middle_0 : u32 = (low_0 + high_0) / u32(2);
        if(u32(qo_indptr_0[middle_0]) <= token_0)
        {
            low_0 = middle_0;
        }
        else
        {
            high_0 = middle_0;
        }
    }
    var _S1 : u32 = low_0 + u32(1);
    var found_0 : Sequence_0;
    found_0.visible_0 = (u32(kv_page_indptr_0[_S1] - kv_page_indptr_0[low_0]) - u32(1)) * params_0.page_size_0 + u32(kv_last_page_lens_0[low_0]) - u32(qo_indptr_0[_S1] - qo_indptr_0[low_0]) + (token_0 - u32(qo_indptr_0[low_0])) + u32(1);
    var _S2 : bool;
    if((params_0.window_0) > u32(0))
    {
        _S2 = (found_0.visible_0) > (params_0.window_0);
    }
    else
    {
        _S2 = false;
    }
    if(_S2)
    {
        high_0 = found_0.visible_0 - params_0.window_0;
    }
    else
    {
        high_0 = u32(0);
    }
    found_0.first_key_0 = high_0;
    found_0.first_page_0 = u32(kv_page_indptr_0[low_0]);
    return found_0;
}

var<workgroup> visible_keys_0 : u32;

var<workgroup> shared_first_key_0 : u32;

var<workgroup> shared_first_page_0 : u32;

var<workgroup> query_0 : array<f32, i32(256)>;

fn kv_row_0( key_0 : u32,  part_0 : u32,  kv_head_0 : u32,  first_page_1 : u32) -> u32
{
    var page_size_1 : u32 = params_0.page_size_0;
    var _S3 : u32 = key_0 / params_0.page_size_0;
    var page_0 : u32 = u32(kv_page_indices_0[first_page_1 + _S3]);
    var offset_0 : u32 = key_0 % page_size_1;
    return params_0.layer_base_0 + ((page_0 * u32(2) + part_0) * page_size_1 + offset_0) * (params_0.kv_heads_0 * params_0.head_dim_0) + kv_head_0 * params_0.head_dim_0;
}

var<workgroup> g_values_0 : array<f32, i32(256)>;

fn group_max_0( value_0 : f32,  lane_0 : u32,  size_0 : u32) -> f32
{
    g_values_0[lane_0] = value_0;
    workgroupBarrier();
    var stride_0 : u32 = size_0 / u32(2);
    for(;;)
    {
        if(stride_0 > u32(0))
        {
        }
        else
        {
            break;
        }
        if(lane_0 < stride_0)
        {
            g_values_0[lane_0] = max(g_values_0[lane_0], g_values_0[lane_0 + stride_0]);
        }
        workgroupBarrier();
        stride_0 = (stride_0 >> (u32(1)));
    }
    var best_0 : f32 = g_values_0[i32(0)];
    workgroupBarrier();
    return best_0;
}

var<workgroup> weights_0 : array<f32, i32(64)>;

fn group_sum_0( value_1 : f32,  lane_1 : u32,  size_1 : u32) -> f32
{
    g_values_0[lane_1] = value_1;
    workgroupBarrier();
    var stride_1 : u32 = size_1 / u32(2);
    for(;;)
    {
        if(stride_1 > u32(0))
        {
        }
        else
        {
            break;
        }
        if(lane_1 < stride_1)
        {
            g_values_0[lane_1] = g_values_0[lane_1] + g_values_0[lane_1 + stride_1];
        }
        workgroupBarrier();
        stride_1 = (stride_1 >> (u32(1)));
    }
    var total_0 : f32 = g_values_0[i32(0)];
    workgroupBarrier();
    return total_0;
}

fn group_attention_0( group_0 : vec3<u32>,  local_0 : vec3<u32>)
{
    var j_0 : u32;
    var score_0 : f32;
    var head_0 : u32 = group_0.x;
    var token_1 : u32 = group_0.y;
    var lane_2 : u32 = local_0.x;
    var head_dim_1 : u32 = params_0.head_dim_0;
    var _S4 : u32 = params_0.num_heads_0 / params_0.kv_heads_0;
    var _S5 : u32 = head_0 / _S4;
    var _S6 : bool = lane_2 == u32(0);
    if(_S6)
    {
        var found_1 : Sequence_0 = find_sequence_0(token_1);
        visible_keys_0 = found_1.visible_0;
        shared_first_key_0 = found_1.first_key_0;
        shared_first_page_0 = found_1.first_page_0;
    }
    var _S7 : u32 = (token_1 * params_0.num_heads_0 + head_0) * head_dim_1;
    var d_0 : u32 = lane_2;
    for(;;)
    {
        if(d_0 < head_dim_1)
        {
        }
        else
        {
            break;
        }
        query_0[d_0] = q_0[_S7 + d_0] * params_0.scale_0;
        d_0 = d_0 + u32(64);
    }
    workgroupBarrier();
    var visible_1 : u32 = (workgroupUniformLoad(&((visible_keys_0))));
    var first_key_1 : u32 = (workgroupUniformLoad(&((shared_first_key_0))));
    var begin_0 : u32 = first_key_1 + min(params_0.key_begin_0, visible_1 - first_key_1);
    var _S8 : u32 = begin_0 + min(params_0.key_count_0, visible_1 - begin_0);
    var at_0 : u32 = (token_1 * params_0.num_heads_0 + head_0) * u32(2);
    var accumulated_0 : array<f32, i32(4)>;
    accumulated_0[i32(0)] = 0.0f;
    accumulated_0[i32(1)] = 0.0f;
    accumulated_0[i32(2)] = 0.0f;
    accumulated_0[i32(3)] = 0.0f;
    var chunk_0 : u32;
    var running_max_0 : f32;
    var running_sum_0 : f32;
    if((params_0.resume_0) != u32(0))
    {
        var _S9 : f32 = state_0[at_0];
        var _S10 : f32 = state_0[at_0 + u32(1)];
        chunk_0 = u32(0);
        for(;;)
        {
            if(chunk_0 < u32(4))
            {
            }
            else
            {
                break;
            }
            var d_1 : u32 = lane_2 + chunk_0 * u32(64);
            if(d_1 < head_dim_1)
            {
                accumulated_0[chunk_0] = result_0[_S7 + d_1];
            }
            chunk_0 = chunk_0 + u32(1);
        }
        running_max_0 = _S9;
        running_sum_0 = _S10;
    }
    else
    {
        running_max_0 = _slang_getInfinity(false);
        running_sum_0 = 0.0f;
    }
    chunk_0 = begin_0;
    for(;;)
    {
        if(chunk_0 < _S8)
        {
        }
        else
        {
            break;
        }
        var key_1 : u32 = chunk_0 + lane_2;
        var _S11 : bool = key_1 < _S8;
        var weight_0 : f32;
        if(_S11)
        {
            var _S12 : u32 = kv_row_0(key_1, u32(0), _S5, shared_first_page_0);
            d_0 = u32(0);
            score_0 = 0.0f;
            for(;;)
            {
                if(d_0 < head_dim_1)
                {
                }
                else
                {
                    break;
                }
                var score_1 : f32 = score_0 + query_0[d_0] * pool_0[_S12 + d_0];
                d_0 = d_0 + u32(1);
                score_0 = score_1;
            }
            if((params_0.softcap_0) > 0.0f)
            {
                weight_0 = params_0.softcap_0 * tanh(score_0 / params_0.softcap_0);
            }
            else
            {
                weight_0 = score_0;
            }
            score_0 = weight_0;
        }
        else
        {
            score_0 = _slang_getInfinity(false);
        }
        var chunk_max_0 : f32 = group_max_0(score_0, lane_2, u32(64));
        var _S13 : f32 = max(running_max_0, chunk_max_0);
        if(_S11)
        {
            weight_0 = exp(score_0 - _S13);
        }
        else
        {
            weight_0 = 0.0f;
        }
        var rescale_0 : f32 = exp(running_max_0 - _S13);
        weights_0[lane_2] = weight_0;
        var _S14 : f32 = running_sum_0 * rescale_0;
        var _S15 : f32 = group_sum_0(weight_0, lane_2, u32(64));
        var _S16 : f32 = _S14 + _S15;
        j_0 = u32(0);
        for(;;)
        {
            if(j_0 < u32(4))
            {
            }
            else
            {
                break;
            }
            accumulated_0[j_0] = accumulated_0[j_0] * rescale_0;
            j_0 = j_0 + u32(1);
        }
        var _S17 : u32 = min(u32(64), _S8 - chunk_0);
        var i_0 : u32 = u32(0);
        for(;;)
        {
            if(i_0 < _S17)
            {
            }
            else
            {
                break;
            }
            var _S18 : u32 = kv_row_0(chunk_0 + i_0, u32(1), _S5, shared_first_page_0);
            var _S19 : f32 = weights_0[i_0];
            var j_1 : u32 = u32(0);
            for(;;)
            {
                if(j_1 < u32(4))
                {
                }
                else
                {
                    break;
                }
                var d_2 : u32 = lane_2 + j_1 * u32(64);
                if(d_2 < head_dim_1)
                {
                    accumulated_0[j_1] = accumulated_0[j_1] + _S19 * pool_0[_S18 + d_2];
                }
                j_1 = j_1 + u32(1);
            }
            i_0 = i_0 + u32(1);
        }
        workgroupBarrier();
        var chunk_1 : u32 = chunk_0 + u32(64);
        running_max_0 = _S13;
        running_sum_0 = _S16;
        chunk_0 = chunk_1;
    }
    if(running_sum_0 > 0.0f)
    {
        score_0 = 1.0f / running_sum_0;
    }
    else
    {
        score_0 = 0.0f;
    }
    if((params_0.finish_0) == u32(0))
    {
        if(_S6)
        {
            state_0[at_0] = running_max_0;
            state_0[at_0 + u32(1)] = running_sum_0;
        }
        score_0 = 1.0f;
    }
    j_0 = u32(0);
    for(;;)
    {
        if(j_0 < u32(4))
        {
        }
        else
        {
            break;
        }
        var d_3 : u32 = lane_2 + j_0 * u32(64);
        if(d_3 < head_dim_1)
        {
            result_0[_S7 + d_3] = accumulated_0[j_0] * score_0;
        }
        j_0 = j_0 + u32(1);
    }
    return;
}

@compute
@workgroup_size(64, 1, 1)
fn attention__group(@builtin(workgroup_id) group_1 : vec3<u32>, @builtin(local_invocation_id) local_1 : vec3<u32>)
{
    group_attention_0(group_1, local_1);
    return;
}



fn _slang_getInfinity(positive: bool) -> f32
{
    let a = select(f32(-1.0), f32(1.0), positive);
    let b = f32(0.0);
    return a / b;
}

@binding(11) @group(0) var<storage, read> pool_words2_0 : array<vec2<u32>>;

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

@binding(9) @group(0) var<storage, read> q4_0 : array<vec4<f32>>;

@binding(4) @group(0) var<storage, read> kv_page_indices_0 : array<i32>;

@binding(7) @group(0) var<storage, read_write> result_0 : array<f32>;

fn kv_unpack_0( word_0 : u32) -> vec2<f32>
{
    return vec2<f32>((bitcast<f32>(((word_0 << (u32(16)))))), (bitcast<f32>(((word_0 & (u32(4294901760)))))));
}

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

fn kv_row_0( key_0 : u32,  part_0 : u32,  kv_head_0 : u32,  first_page_1 : u32) -> u32
{
    var page_size_1 : u32 = params_0.page_size_0;
    var _S3 : u32 = key_0 / params_0.page_size_0;
    var page_0 : u32 = u32(kv_page_indices_0[first_page_1 + _S3]);
    var offset_0 : u32 = key_0 % page_size_1;
    return params_0.layer_base_0 + ((page_0 * u32(2) + part_0) * page_size_1 + offset_0) * (params_0.kv_heads_0 * params_0.head_dim_0) + kv_head_0 * params_0.head_dim_0;
}

fn serial_attention_0( group_0 : vec3<u32>,  local_0 : vec3<u32>)
{
    var head_0 : u32 = group_0.x * u32(8) + local_0.x;
    var token_1 : u32 = group_0.y;
    if(head_0 >= (params_0.num_heads_0))
    {
        return;
    }
    var vectors_0 : u32 = params_0.head_dim_0 / u32(4);
    var _S4 : u32 = params_0.num_heads_0 / params_0.kv_heads_0;
    var _S5 : u32 = head_0 / _S4;
    var sequence_0 : Sequence_0 = find_sequence_0(token_1);
    var _S6 : u32 = (token_1 * params_0.num_heads_0 + head_0) * vectors_0;
    var query_0 : array<vec4<f32>, i32(64)>;
    var accumulated_0 : array<vec4<f32>, i32(64)>;
    var v_0 : u32 = u32(0);
    for(;;)
    {
        if(v_0 < vectors_0)
        {
        }
        else
        {
            break;
        }
        query_0[v_0] = q4_0[_S6 + v_0] * vec4<f32>(params_0.scale_0);
        accumulated_0[v_0] = vec4<f32>(0.0f);
        v_0 = v_0 + u32(1);
    }
    var running_max_0 : f32 = _slang_getInfinity(false);
    var running_sum_0 : f32 = 0.0f;
    var key_1 : u32 = sequence_0.first_key_0;
    for(;;)
    {
        if(key_1 < (sequence_0.visible_0))
        {
        }
        else
        {
            break;
        }
        var _S7 : u32 = kv_row_0(key_1, u32(0), _S5, sequence_0.first_page_0);
        var _S8 : u32 = _S7 / u32(4);
        v_0 = u32(0);
        var score_0 : f32 = 0.0f;
        for(;;)
        {
            if(v_0 < vectors_0)
            {
            }
            else
            {
                break;
            }
            var words_0 : vec2<u32> = pool_words2_0[_S8 + v_0];
            var score_1 : f32 = score_0 + dot(query_0[v_0], vec4<f32>(kv_unpack_0(words_0.x), kv_unpack_0(words_0.y)));
            v_0 = v_0 + u32(1);
            score_0 = score_1;
        }
        var score_2 : f32;
        if((params_0.softcap_0) > 0.0f)
        {
            score_2 = params_0.softcap_0 * tanh(score_0 / params_0.softcap_0);
        }
        else
        {
            score_2 = score_0;
        }
        var _S9 : f32 = max(running_max_0, score_2);
        var rescale_0 : f32 = exp(running_max_0 - _S9);
        var weight_0 : f32 = exp(score_2 - _S9);
        var _S10 : f32 = running_sum_0 * rescale_0 + weight_0;
        var _S11 : u32 = kv_row_0(key_1, u32(1), _S5, sequence_0.first_page_0);
        var _S12 : u32 = _S11 / u32(4);
        var v_1 : u32 = u32(0);
        for(;;)
        {
            if(v_1 < vectors_0)
            {
            }
            else
            {
                break;
            }
            var words_1 : vec2<u32> = pool_words2_0[_S12 + v_1];
            accumulated_0[v_1] = accumulated_0[v_1] * vec4<f32>(rescale_0) + vec4<f32>(weight_0) * vec4<f32>(kv_unpack_0(words_1.x), kv_unpack_0(words_1.y));
            v_1 = v_1 + u32(1);
        }
        var _S13 : u32 = key_1 + u32(1);
        running_max_0 = _S9;
        running_sum_0 = _S10;
        key_1 = _S13;
    }
    if(running_sum_0 > 0.0f)
    {
        running_max_0 = 1.0f / running_sum_0;
    }
    else
    {
        running_max_0 = 0.0f;
    }
    v_0 = u32(0);
    for(;;)
    {
        if(v_0 < vectors_0)
        {
        }
        else
        {
            break;
        }
        var out4_0 : vec4<f32> = accumulated_0[v_0] * vec4<f32>(running_max_0);
        var at_0 : u32 = (_S6 + v_0) * u32(4);
        result_0[at_0] = out4_0.x;
        result_0[at_0 + u32(1)] = out4_0.y;
        result_0[at_0 + u32(2)] = out4_0.z;
        result_0[at_0 + u32(3)] = out4_0.w;
        v_0 = v_0 + u32(1);
    }
    return;
}

@compute
@workgroup_size(8, 1, 1)
fn attention__serial__bf16(@builtin(workgroup_id) group_1 : vec3<u32>, @builtin(local_invocation_id) local_1 : vec3<u32>)
{
    serial_attention_0(group_1, local_1);
    return;
}


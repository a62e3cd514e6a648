struct AppendParams_std140_0
{
    @align(16) tokens_0 : u32,
    @align(4) kv_width_0 : u32,
    @align(8) page_size_0 : u32,
    @align(4) layer_base_0 : u32,
    @align(16) groups_x_0 : u32,
};

@binding(0) @group(0) var<uniform> params_0 : AppendParams_std140_0;
@binding(4) @group(0) var<storage, read> slots_0 : array<i32>;

@binding(2) @group(0) var<storage, read> k_0 : array<f32>;

@binding(3) @group(0) var<storage, read> v_0 : array<f32>;

@binding(5) @group(0) var<storage, read_write> pool_words_0 : array<u32>;

fn f16_bits_0( x_0 : f32) -> u32
{
    var bits_0 : u32 = (bitcast<u32>((x_0)));
    var sign_0 : u32 = (((bits_0 >> (u32(16)))) & (u32(32768)));
    var magnitude_0 : u32 = (bits_0 & (u32(2147483647)));
    var _S1 : i32;
    if(magnitude_0 >= u32(2139095040))
    {
        if(magnitude_0 > u32(2139095040))
        {
            _S1 = i32(32256);
        }
        else
        {
            _S1 = i32(31744);
        }
        return (sign_0 | (u32(_S1)));
    }
    if(magnitude_0 >= u32(1199566848))
    {
        return (sign_0 | (u32(31744)));
    }
    if(magnitude_0 >= u32(947912704))
    {
        var rebiased_0 : u32 = magnitude_0 - u32(939524096);
        return (sign_0 | ((((rebiased_0 + u32(4095) + ((((rebiased_0 >> (u32(13)))) & (u32(1))))) >> (u32(13))))));
    }
    if(magnitude_0 < u32(855638016))
    {
        return sign_0;
    }
    var shift_0 : u32 = u32(126) - ((magnitude_0 >> (u32(23))));
    var significand_0 : u32 = (((magnitude_0 & (u32(8388607)))) | (u32(8388608)));
    var kept_0 : u32 = (significand_0 >> (shift_0));
    var rest_0 : u32 = (significand_0 & ((((u32(1) << (shift_0))) - u32(1))));
    var half_0 : u32 = (u32(1) << ((shift_0 - u32(1))));
    var _S2 : bool;
    if(rest_0 > half_0)
    {
        _S2 = true;
    }
    else
    {
        if(rest_0 == half_0)
        {
            _S2 = ((kept_0 & (u32(1)))) == u32(1);
        }
        else
        {
            _S2 = false;
        }
    }
    if(_S2)
    {
        _S1 = i32(1);
    }
    else
    {
        _S1 = i32(0);
    }
    return (sign_0 | ((kept_0 + u32(_S1))));
}

fn kv_pack_0( low_0 : f32,  high_0 : f32) -> u32
{
    return ((f16_bits_0(low_0)) | ((((f16_bits_0(high_0)) << (u32(16))))));
}

fn flat_index_0( group_0 : vec3<u32>,  lane_0 : u32,  groups_x_1 : u32,  group_size_0 : u32) -> u32
{
    return (group_0.y * groups_x_1 + group_0.x) * group_size_0 + lane_0;
}

fn append_0( group_1 : vec3<u32>,  lane_1 : u32)
{
    var i_0 : u32 = flat_index_0(group_1, lane_1, params_0.groups_x_0, u32(256));
    var _S3 : u32 = params_0.kv_width_0 / u32(2);
    if(i_0 >= (params_0.tokens_0 * _S3))
    {
        return;
    }
    var token_0 : u32 = i_0 / _S3;
    var column_0 : u32 = i_0 - token_0 * _S3;
    var slot_0 : i32 = slots_0[token_0];
    if(slot_0 < i32(0))
    {
        return;
    }
    var _S4 : u32 = u32(slot_0);
    var page_0 : u32 = _S4 / params_0.page_size_0;
    var offset_0 : u32 = _S4 - page_0 * params_0.page_size_0;
    var key_at_0 : u32 = params_0.layer_base_0 / u32(2) + (page_0 * u32(2) * params_0.page_size_0 + offset_0) * _S3 + column_0;
    var value_at_0 : u32 = key_at_0 + params_0.page_size_0 * _S3;
    var first_0 : u32 = u32(2) * i_0;
    var _S5 : u32 = first_0 + u32(1);
    pool_words_0[key_at_0] = kv_pack_0(k_0[first_0], k_0[_S5]);
    pool_words_0[value_at_0] = kv_pack_0(v_0[first_0], v_0[_S5]);
    return;
}

@compute
@workgroup_size(256, 1, 1)
fn append_kv__f16(@builtin(workgroup_id) group_2 : vec3<u32>, @builtin(local_invocation_id) local_0 : vec3<u32>)
{
    append_0(group_2, local_0.x);
    return;
}


struct LinearParams_std140_0
{
    @align(16) tokens_0 : u32,
    @align(4) outputs_0 : u32,
    @align(8) inputs_0 : u32,
    @align(4) has_bias_0 : u32,
    @align(16) eps_0 : f32,
    @align(4) out_stride_0 : u32,
};

@binding(0) @group(0) var<uniform> params_0 : LinearParams_std140_0;
@binding(3) @group(0) var<storage, read> bias_0 : array<f32>;

@binding(7) @group(0) var<storage, read> x4_0 : array<vec4<f32>>;

@binding(6) @group(0) var<storage, read_write> result_0 : array<f32>;

@binding(10) @group(0) var<storage, read> weight_words_0 : array<u32>;

fn WeightWords_word_0( index_0 : u32) -> u32
{
    return weight_words_0[index_0];
}

fn words_from_0( half_0 : u32,  result_1 : ptr<function, array<u32, i32(4)>>)
{
    var index_1 : u32 = (half_0 >> (u32(1)));
    var _S1 : u32 = ((half_0 & (u32(1)))) * u32(16);
    var _S2 : u32 = index_1 + u32(1);
    var _S3 : u32 = WeightWords_word_0(_S2);
    var _S4 : u32 = u32(16) - _S1;
    (*result_1)[i32(0)] = ((((WeightWords_word_0(index_1)) >> (_S1))) | (((((_S3 << (_S4))) << (u32(16))))));
    var _S5 : u32 = WeightWords_word_0(_S2 + u32(1));
    (*result_1)[i32(1)] = (((_S3 >> (_S1))) | (((((_S5 << (_S4))) << (u32(16))))));
    var _S6 : u32 = WeightWords_word_0(_S2 + u32(2));
    (*result_1)[i32(2)] = (((_S5 >> (_S1))) | (((((_S6 << (_S4))) << (u32(16))))));
    (*result_1)[i32(3)] = (((_S6 >> (_S1))) | ((((((WeightWords_word_0(_S2 + u32(3))) << (_S4))) << (u32(16))))));
    return;
}

fn word_from_half_0( half_1 : u32) -> u32
{
    var index_2 : u32 = (half_1 >> (u32(1)));
    var shift_0 : u32 = ((half_1 & (u32(1)))) * u32(16);
    return ((((WeightWords_word_0(index_2)) >> (shift_0))) | ((((((WeightWords_word_0(index_2 + u32(1))) << ((u32(16) - shift_0)))) << (u32(16))))));
}

fn half_at_0( half_2 : u32) -> f32
{
    return (unpack2x16float((((((WeightWords_word_0((half_2 >> (u32(1))))) >> ((((half_2 & (u32(1)))) * u32(16))))) & (u32(65535))))).x);
}

fn block_halves_0() -> u32
{
    return u32(11);
}

fn finish_0( dot_0 : f32,  up_0 : f32,  inverse_rms_0 : f32,  token_0 : u32,  column_0 : u32) -> f32
{
    var y_0 : f32;
    if((params_0.has_bias_0) != u32(0))
    {
        y_0 = dot_0 + bias_0[column_0];
    }
    else
    {
        y_0 = dot_0;
    }
    return y_0;
}

fn spread_bits_0( bits_0 : u32) -> u32
{
    return (((((((bits_0 & (u32(1)))) | (((((bits_0 & (u32(2)))) << (u32(7))))))) | (((((bits_0 & (u32(4)))) << (u32(14))))))) | (((((bits_0 & (u32(8)))) << (u32(21))))));
}

fn unsigned_bytes_0( w_0 : u32) -> vec4<f32>
{
    return vec4<f32>(f32((w_0 & (u32(255)))), f32((((w_0 >> (u32(8)))) & (u32(255)))), f32((((w_0 >> (u32(16)))) & (u32(255)))), f32((w_0 >> (u32(24)))));
}

fn stored_block_0( row_0 : u32,  block_0 : u32,  values_0 : ptr<function, array<vec4<f32>, i32(8)>>)
{
    var start_0 : u32 = row_0 + block_0 * block_halves_0();
    var _S7 : f32 = half_at_0(start_0);
    var _S8 : u32 = word_from_half_0(start_0 + u32(1));
    var qs_0 : array<u32, i32(4)>;
    words_from_0(start_0 + u32(3), &(qs_0));
    var _S9 : vec4<f32> = vec4<f32>(16.0f);
    var _S10 : vec4<f32> = vec4<f32>(_S7);
    (*values_0)[i32(0)] = _S10 * (unsigned_bytes_0(((((qs_0[i32(0)]) & (u32(252645135)))) | ((((spread_bits_0((_S8 >> (u32(0))))) << (u32(4))))))) - _S9);
    (*values_0)[i32(4)] = _S10 * (unsigned_bytes_0(((((((qs_0[i32(0)]) >> (u32(4)))) & (u32(252645135)))) | ((((spread_bits_0((_S8 >> (u32(16))))) << (u32(4))))))) - _S9);
    (*values_0)[i32(1)] = _S10 * (unsigned_bytes_0(((((qs_0[i32(1)]) & (u32(252645135)))) | ((((spread_bits_0((_S8 >> (u32(4))))) << (u32(4))))))) - _S9);
    (*values_0)[i32(5)] = _S10 * (unsigned_bytes_0(((((((qs_0[i32(1)]) >> (u32(4)))) & (u32(252645135)))) | ((((spread_bits_0((_S8 >> (u32(20))))) << (u32(4))))))) - _S9);
    (*values_0)[i32(2)] = _S10 * (unsigned_bytes_0(((((qs_0[i32(2)]) & (u32(252645135)))) | ((((spread_bits_0((_S8 >> (u32(8))))) << (u32(4))))))) - _S9);
    (*values_0)[i32(6)] = _S10 * (unsigned_bytes_0(((((((qs_0[i32(2)]) >> (u32(4)))) & (u32(252645135)))) | ((((spread_bits_0((_S8 >> (u32(24))))) << (u32(4))))))) - _S9);
    (*values_0)[i32(3)] = _S10 * (unsigned_bytes_0(((((qs_0[i32(3)]) & (u32(252645135)))) | ((((spread_bits_0((_S8 >> (u32(12))))) << (u32(4))))))) - _S9);
    (*values_0)[i32(7)] = _S10 * (unsigned_bytes_0(((((((qs_0[i32(3)]) >> (u32(4)))) & (u32(252645135)))) | ((((spread_bits_0((_S8 >> (u32(28))))) << (u32(4))))))) - _S9);
    return;
}

fn row_halves_0( columns_0 : u32) -> u32
{
    return columns_0 / u32(32) * block_halves_0();
}

fn rows_0( group_0 : vec3<u32>,  lane_0 : u32)
{
    var _S11 : u32;
    var N_0 : u32 = params_0.outputs_0;
    var _S12 : u32 = params_0.tokens_0;
    var _S13 : u32 = params_0.inputs_0 / u32(4);
    var n_0 : u32 = group_0.x * u32(64) + lane_0;
    var _S14 : u32 = group_0.y * u32(4);
    var _S15 : u32 = min(n_0, params_0.outputs_0 - u32(1));
    var dots_0 : array<f32, i32(4)>;
    var ups_0 : array<f32, i32(4)>;
    var tb_0 : i32 = i32(0);
    for(;;)
    {
        if(tb_0 < i32(4))
        {
        }
        else
        {
            break;
        }
        dots_0[tb_0] = 0.0f;
        ups_0[tb_0] = 0.0f;
        tb_0 = tb_0 + i32(1);
    }
    var _S16 : u32 = row_halves_0(params_0.inputs_0);
    var block_1 : u32 = u32(0);
    for(;;)
    {
        if(block_1 < (_S13 / u32(8)))
        {
        }
        else
        {
            break;
        }
        var ws_0 : array<vec4<f32>, i32(8)>;
        stored_block_0(_S15 * _S16, block_1, &(ws_0));
        for(;;)
        {
            for(;;)
            {
                for(;;)
                {
                    var _S17 : u32 = block_1 * u32(8);
                    _S11 = _S17;
                    var _S18 : vec4<f32> = ws_0[i32(0)];
                    tb_0 = i32(0);
                    for(;;)
                    {
                        if(tb_0 < i32(4))
                        {
                        }
                        else
                        {
                            break;
                        }
                        dots_0[tb_0] = dots_0[tb_0] + dot(x4_0[min(_S14 + u32(tb_0), _S12 - u32(1)) * _S13 + _S17], _S18);
                        tb_0 = tb_0 + i32(1);
                    }
                    break;
                }
                break;
            }
            for(;;)
            {
                for(;;)
                {
                    var k_0 : u32 = _S11 + u32(1);
                    var _S19 : vec4<f32> = ws_0[i32(1)];
                    var tb_1 : i32 = i32(0);
                    for(;;)
                    {
                        if(tb_1 < i32(4))
                        {
                        }
                        else
                        {
                            break;
                        }
                        dots_0[tb_1] = dots_0[tb_1] + dot(x4_0[min(_S14 + u32(tb_1), _S12 - u32(1)) * _S13 + k_0], _S19);
                        tb_1 = tb_1 + i32(1);
                    }
                    break;
                }
                break;
            }
            for(;;)
            {
                for(;;)
                {
                    var k_1 : u32 = _S11 + u32(2);
                    var _S20 : vec4<f32> = ws_0[i32(2)];
                    var tb_2 : i32 = i32(0);
                    for(;;)
                    {
                        if(tb_2 < i32(4))
                        {
                        }
                        else
                        {
                            break;
                        }
                        dots_0[tb_2] = dots_0[tb_2] + dot(x4_0[min(_S14 + u32(tb_2), _S12 - u32(1)) * _S13 + k_1], _S20);
                        tb_2 = tb_2 + i32(1);
                    }
                    break;
                }
                break;
            }
            for(;;)
            {
                for(;;)
                {
                    var k_2 : u32 = _S11 + u32(3);
                    var _S21 : vec4<f32> = ws_0[i32(3)];
                    var tb_3 : i32 = i32(0);
                    for(;;)
                    {
                        if(tb_3 < i32(4))
                        {
                        }
                        else
                        {
                            break;
                        }
                        dots_0[tb_3] = dots_0[tb_3] + dot(x4_0[min(_S14 + u32(tb_3), _S12 - u32(1)) * _S13 + k_2], _S21);
                        tb_3 = tb_3 + i32(1);
                    }
                    break;
                }
                break;
            }
            for(;;)
            {
                for(;;)
                {
                    var k_3 : u32 = _S11 + u32(4);
                    var _S22 : vec4<f32> = ws_0[i32(4)];
                    var tb_4 : i32 = i32(0);
                    for(;;)
                    {
                        if(tb_4 < i32(4))
                        {
                        }
                        else
                        {
                            break;
                        }
                        dots_0[tb_4] = dots_0[tb_4] + dot(x4_0[min(_S14 + u32(tb_4), _S12 - u32(1)) * _S13 + k_3], _S22);
                        tb_4 = tb_4 + i32(1);
                    }
                    break;
                }
                break;
            }
            for(;;)
            {
                for(;;)
                {
                    var k_4 : u32 = _S11 + u32(5);
                    var _S23 : vec4<f32> = ws_0[i32(5)];
                    var tb_5 : i32 = i32(0);
                    for(;;)
                    {
                        if(tb_5 < i32(4))
                        {
                        }
                        else
                        {
                            break;
                        }
                        dots_0[tb_5] = dots_0[tb_5] + dot(x4_0[min(_S14 + u32(tb_5), _S12 - u32(1)) * _S13 + k_4], _S23);
                        tb_5 = tb_5 + i32(1);
                    }
                    break;
                }
                break;
            }
            for(;;)
            {
                for(;;)
                {
                    var k_5 : u32 = _S11 + u32(6);
                    var _S24 : vec4<f32> = ws_0[i32(6)];
                    var tb_6 : i32 = i32(0);
                    for(;;)
                    {
                        if(tb_6 < i32(4))
                        {
                        }
                        else
                        {
                            break;
                        }
                        dots_0[tb_6] = dots_0[tb_6] + dot(x4_0[min(_S14 + u32(tb_6), _S12 - u32(1)) * _S13 + k_5], _S24);
                        tb_6 = tb_6 + i32(1);
                    }
                    break;
                }
                break;
            }
            for(;;)
            {
                for(;;)
                {
                    var k_6 : u32 = _S11 + u32(7);
                    var _S25 : vec4<f32> = ws_0[i32(7)];
                    var tb_7 : i32 = i32(0);
                    for(;;)
                    {
                        if(tb_7 < i32(4))
                        {
                        }
                        else
                        {
                            break;
                        }
                        dots_0[tb_7] = dots_0[tb_7] + dot(x4_0[min(_S14 + u32(tb_7), _S12 - u32(1)) * _S13 + k_6], _S25);
                        tb_7 = tb_7 + i32(1);
                    }
                    break;
                }
                break;
            }
            break;
        }
        block_1 = block_1 + u32(1);
    }
    if(n_0 >= N_0)
    {
        return;
    }
    tb_0 = i32(0);
    for(;;)
    {
        if(tb_0 < i32(4))
        {
        }
        else
        {
            break;
        }
        var t_0 : u32 = _S14 + u32(tb_0);
        if(t_0 < _S12)
        {
            result_0[t_0 * params_0.out_stride_0 + n_0] = finish_0(dots_0[tb_0], ups_0[tb_0], 1.0f, t_0, n_0);
        }
        tb_0 = tb_0 + i32(1);
    }
    return;
}

@compute
@workgroup_size(64, 1, 1)
fn linear__rows_b4__q5_0(@builtin(workgroup_id) group_1 : vec3<u32>, @builtin(local_invocation_id) local_0 : vec3<u32>)
{
    rows_0(group_1, local_0.x);
    return;
}


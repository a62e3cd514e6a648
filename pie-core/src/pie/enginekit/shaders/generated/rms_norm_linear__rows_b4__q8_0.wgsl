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

@binding(9) @group(0) var<storage, read> norm_weight4_0 : array<vec4<f32>>;

@binding(7) @group(0) var<storage, read> x4_0 : array<vec4<f32>>;

@binding(6) @group(0) var<storage, read_write> result_0 : array<f32>;

@binding(10) @group(0) var<storage, read> weight_words_0 : array<u32>;

fn WeightWords_word_0( index_0 : u32) -> u32
{
    return weight_words_0[index_0];
}

fn half_at_0( half_0 : u32) -> f32
{
    return (unpack2x16float((((((WeightWords_word_0((half_0 >> (u32(1))))) >> ((((half_0 & (u32(1)))) * u32(16))))) & (u32(65535))))).x);
}

fn block_halves_0() -> u32
{
    return u32(17);
}

fn finish_0( dot_0 : f32,  up_0 : f32,  inverse_rms_0 : f32,  token_0 : u32,  column_0 : u32) -> f32
{
    var _S1 : f32 = dot_0 * inverse_rms_0;
    var y_0 : f32;
    if((params_0.has_bias_0) != u32(0))
    {
        y_0 = _S1 + bias_0[column_0];
    }
    else
    {
        y_0 = _S1;
    }
    return y_0;
}

fn signed_bytes_0( w_0 : u32) -> vec4<f32>
{
    return vec4<f32>(f32((i32((w_0 << (u32(24)))) >> (u32(24)))), f32((i32((w_0 << (u32(16)))) >> (u32(24)))), f32((i32((w_0 << (u32(8)))) >> (u32(24)))), f32((i32(w_0) >> (u32(24)))));
}

fn stored_block_0( row_0 : u32,  block_0 : u32,  values_0 : ptr<function, array<vec4<f32>, i32(8)>>)
{
    var start_0 : u32 = row_0 + block_0 * block_halves_0();
    var quants_0 : u32 = start_0 + u32(1);
    var index_1 : u32 = (quants_0 >> (u32(1)));
    var _S2 : u32 = ((quants_0 & (u32(1)))) * u32(16);
    var _S3 : u32 = index_1 + u32(1);
    var _S4 : u32 = WeightWords_word_0(_S3);
    var _S5 : u32 = u32(16) - _S2;
    var _S6 : vec4<f32> = vec4<f32>(half_at_0(start_0));
    (*values_0)[i32(0)] = _S6 * signed_bytes_0(((((WeightWords_word_0(index_1)) >> (_S2))) | (((((_S4 << (_S5))) << (u32(16)))))));
    var _S7 : u32 = WeightWords_word_0(_S3 + u32(1));
    (*values_0)[i32(1)] = _S6 * signed_bytes_0((((_S4 >> (_S2))) | (((((_S7 << (_S5))) << (u32(16)))))));
    var _S8 : u32 = WeightWords_word_0(_S3 + u32(2));
    (*values_0)[i32(2)] = _S6 * signed_bytes_0((((_S7 >> (_S2))) | (((((_S8 << (_S5))) << (u32(16)))))));
    var _S9 : u32 = WeightWords_word_0(_S3 + u32(3));
    (*values_0)[i32(3)] = _S6 * signed_bytes_0((((_S8 >> (_S2))) | (((((_S9 << (_S5))) << (u32(16)))))));
    var _S10 : u32 = WeightWords_word_0(_S3 + u32(4));
    (*values_0)[i32(4)] = _S6 * signed_bytes_0((((_S9 >> (_S2))) | (((((_S10 << (_S5))) << (u32(16)))))));
    var _S11 : u32 = WeightWords_word_0(_S3 + u32(5));
    (*values_0)[i32(5)] = _S6 * signed_bytes_0((((_S10 >> (_S2))) | (((((_S11 << (_S5))) << (u32(16)))))));
    var _S12 : u32 = WeightWords_word_0(_S3 + u32(6));
    (*values_0)[i32(6)] = _S6 * signed_bytes_0((((_S11 >> (_S2))) | (((((_S12 << (_S5))) << (u32(16)))))));
    (*values_0)[i32(7)] = _S6 * signed_bytes_0((((_S12 >> (_S2))) | ((((((WeightWords_word_0(_S3 + u32(7))) << (_S5))) << (u32(16)))))));
    return;
}

fn row_halves_0( columns_0 : u32) -> u32
{
    return columns_0 / u32(32) * block_halves_0();
}

fn inverse_rms_1( squares_0 : f32) -> f32
{
    return 1.0f / sqrt(squares_0 / f32(params_0.inputs_0) + params_0.eps_0);
}

fn rows_0( group_0 : vec3<u32>,  lane_0 : u32)
{
    var _S13 : u32;
    var N_0 : u32 = params_0.outputs_0;
    var _S14 : u32 = params_0.tokens_0;
    var _S15 : u32 = params_0.inputs_0 / u32(4);
    var n_0 : u32 = group_0.x * u32(64) + lane_0;
    var _S16 : u32 = group_0.y * u32(4);
    var _S17 : u32 = min(n_0, params_0.outputs_0 - u32(1));
    var dots_0 : array<f32, i32(4)>;
    var ups_0 : array<f32, i32(4)>;
    var squares_1 : array<f32, i32(4)>;
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
        squares_1[tb_0] = 0.0f;
        tb_0 = tb_0 + i32(1);
    }
    var _S18 : u32 = row_halves_0(params_0.inputs_0);
    var block_1 : u32 = u32(0);
    for(;;)
    {
        if(block_1 < (_S15 / u32(8)))
        {
        }
        else
        {
            break;
        }
        var ws_0 : array<vec4<f32>, i32(8)>;
        stored_block_0(_S17 * _S18, block_1, &(ws_0));
        for(;;)
        {
            for(;;)
            {
                for(;;)
                {
                    var _S19 : u32 = block_1 * u32(8);
                    _S13 = _S19;
                    var _S20 : vec4<f32> = ws_0[i32(0)] * norm_weight4_0[_S19];
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
                        var xs_0 : vec4<f32> = x4_0[min(_S16 + u32(tb_0), _S14 - u32(1)) * _S15 + _S19];
                        dots_0[tb_0] = dots_0[tb_0] + dot(xs_0, _S20);
                        squares_1[tb_0] = squares_1[tb_0] + dot(xs_0, xs_0);
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
                    var k_0 : u32 = _S13 + u32(1);
                    var _S21 : vec4<f32> = ws_0[i32(1)] * norm_weight4_0[k_0];
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
                        var xs_1 : vec4<f32> = x4_0[min(_S16 + u32(tb_1), _S14 - u32(1)) * _S15 + k_0];
                        dots_0[tb_1] = dots_0[tb_1] + dot(xs_1, _S21);
                        squares_1[tb_1] = squares_1[tb_1] + dot(xs_1, xs_1);
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
                    var k_1 : u32 = _S13 + u32(2);
                    var _S22 : vec4<f32> = ws_0[i32(2)] * norm_weight4_0[k_1];
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
                        var xs_2 : vec4<f32> = x4_0[min(_S16 + u32(tb_2), _S14 - u32(1)) * _S15 + k_1];
                        dots_0[tb_2] = dots_0[tb_2] + dot(xs_2, _S22);
                        squares_1[tb_2] = squares_1[tb_2] + dot(xs_2, xs_2);
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
                    var k_2 : u32 = _S13 + u32(3);
                    var _S23 : vec4<f32> = ws_0[i32(3)] * norm_weight4_0[k_2];
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
                        var xs_3 : vec4<f32> = x4_0[min(_S16 + u32(tb_3), _S14 - u32(1)) * _S15 + k_2];
                        dots_0[tb_3] = dots_0[tb_3] + dot(xs_3, _S23);
                        squares_1[tb_3] = squares_1[tb_3] + dot(xs_3, xs_3);
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
                    var k_3 : u32 = _S13 + u32(4);
                    var _S24 : vec4<f32> = ws_0[i32(4)] * norm_weight4_0[k_3];
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
                        var xs_4 : vec4<f32> = x4_0[min(_S16 + u32(tb_4), _S14 - u32(1)) * _S15 + k_3];
                        dots_0[tb_4] = dots_0[tb_4] + dot(xs_4, _S24);
                        squares_1[tb_4] = squares_1[tb_4] + dot(xs_4, xs_4);
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
                    var k_4 : u32 = _S13 + u32(5);
                    var _S25 : vec4<f32> = ws_0[i32(5)] * norm_weight4_0[k_4];
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
                        var xs_5 : vec4<f32> = x4_0[min(_S16 + u32(tb_5), _S14 - u32(1)) * _S15 + k_4];
                        dots_0[tb_5] = dots_0[tb_5] + dot(xs_5, _S25);
                        squares_1[tb_5] = squares_1[tb_5] + dot(xs_5, xs_5);
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
                    var k_5 : u32 = _S13 + u32(6);
                    var _S26 : vec4<f32> = ws_0[i32(6)] * norm_weight4_0[k_5];
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
                        var xs_6 : vec4<f32> = x4_0[min(_S16 + u32(tb_6), _S14 - u32(1)) * _S15 + k_5];
                        dots_0[tb_6] = dots_0[tb_6] + dot(xs_6, _S26);
                        squares_1[tb_6] = squares_1[tb_6] + dot(xs_6, xs_6);
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
                    var k_6 : u32 = _S13 + u32(7);
                    var _S27 : vec4<f32> = ws_0[i32(7)] * norm_weight4_0[k_6];
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
                        var xs_7 : vec4<f32> = x4_0[min(_S16 + u32(tb_7), _S14 - u32(1)) * _S15 + k_6];
                        dots_0[tb_7] = dots_0[tb_7] + dot(xs_7, _S27);
                        squares_1[tb_7] = squares_1[tb_7] + dot(xs_7, xs_7);
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
        var t_0 : u32 = _S16 + u32(tb_0);
        if(t_0 < _S14)
        {
            result_0[t_0 * params_0.out_stride_0 + n_0] = finish_0(dots_0[tb_0], ups_0[tb_0], inverse_rms_1(squares_1[tb_0]), t_0, n_0);
        }
        tb_0 = tb_0 + i32(1);
    }
    return;
}

@compute
@workgroup_size(64, 1, 1)
fn rms_norm_linear__rows_b4__q8_0(@builtin(workgroup_id) group_1 : vec3<u32>, @builtin(local_invocation_id) local_0 : vec3<u32>)
{
    rows_0(group_1, local_0.x);
    return;
}


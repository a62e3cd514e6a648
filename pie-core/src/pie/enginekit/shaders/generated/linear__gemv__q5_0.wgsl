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

@binding(1) @group(0) var<storage, read> x_0 : array<f32>;

@binding(6) @group(0) var<storage, read_write> result_0 : array<f32>;

@binding(10) @group(0) var<storage, read> weight_words_0 : array<u32>;

fn WeightWords_word_0( index_0 : u32) -> u32
{
    return weight_words_0[index_0];
}

fn word_from_half_0( half_0 : u32) -> u32
{
    var index_1 : u32 = (half_0 >> (u32(1)));
    var shift_0 : u32 = ((half_0 & (u32(1)))) * u32(16);
    return ((((WeightWords_word_0(index_1)) >> (shift_0))) | ((((((WeightWords_word_0(index_1 + u32(1))) << ((u32(16) - shift_0)))) << (u32(16))))));
}

fn byte_at_0( byte_0 : u32) -> u32
{
    return ((((WeightWords_word_0((byte_0 >> (u32(2))))) >> ((((byte_0 & (u32(3)))) * u32(8))))) & (u32(255)));
}

fn half_at_0( half_1 : u32) -> f32
{
    return (unpack2x16float((((((WeightWords_word_0((half_1 >> (u32(1))))) >> ((((half_1 & (u32(1)))) * u32(16))))) & (u32(65535))))).x);
}

fn block_halves_0() -> u32
{
    return u32(11);
}

fn stored_at_0( row_0 : u32,  k_0 : u32) -> f32
{
    var block_0 : u32 = row_0 + k_0 / u32(32) * block_halves_0();
    var j_0 : u32 = k_0 % u32(32);
    var _S1 : f32 = half_at_0(block_0);
    var _S2 : u32 = byte_at_0(u32(2) * block_0 + u32(6) + ((j_0 & (u32(15)))));
    var _S3 : i32;
    if(j_0 >= u32(16))
    {
        _S3 = i32(4);
    }
    else
    {
        _S3 = i32(0);
    }
    return _S1 * (f32((((((_S2 >> (u32(_S3)))) & (u32(15)))) | ((((((((word_from_half_0(block_0 + u32(1))) >> (j_0))) & (u32(1)))) << (u32(4))))))) - 16.0f);
}

fn row_halves_0( columns_0 : u32) -> u32
{
    return columns_0 / u32(32) * block_halves_0();
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

var<workgroup> gemv_partial_0 : array<f32, i32(2560)>;

var<workgroup> gemv_total_0 : array<f32, i32(40)>;

fn gemv_0( group_0 : vec3<u32>,  lane_0 : u32)
{
    var n0_0 : u32 = group_0.x * u32(4);
    var _S4 : u32 = group_0.y;
    var _S5 : u32 = params_0.inputs_0;
    var N_0 : u32 = params_0.outputs_0;
    var T_0 : u32 = params_0.tokens_0;
    var dots_0 : array<f32, i32(4)>;
    var squares_0 : array<f32, i32(1)>;
    var i_0 : i32 = i32(0);
    for(;;)
    {
        if(i_0 < i32(4))
        {
        }
        else
        {
            break;
        }
        dots_0[i_0] = 0.0f;
        i_0 = i_0 + i32(1);
    }
    var tb_0 : i32 = i32(0);
    for(;;)
    {
        if(tb_0 < i32(1))
        {
        }
        else
        {
            break;
        }
        squares_0[tb_0] = 0.0f;
        tb_0 = tb_0 + i32(1);
    }
    var k_1 : u32 = lane_0;
    for(;;)
    {
        if(k_1 < _S5)
        {
        }
        else
        {
            break;
        }
        var xs_0 : array<f32, i32(1)>;
        tb_0 = i32(0);
        for(;;)
        {
            if(tb_0 < i32(1))
            {
            }
            else
            {
                break;
            }
            var _S6 : f32 = x_0[min(_S4 + u32(tb_0), T_0 - u32(1)) * _S5 + k_1];
            xs_0[tb_0] = _S6;
            squares_0[tb_0] = squares_0[tb_0] + _S6 * _S6;
            tb_0 = tb_0 + i32(1);
        }
        var r_0 : i32 = i32(0);
        for(;;)
        {
            if(r_0 < i32(4))
            {
            }
            else
            {
                break;
            }
            var _S7 : f32 = stored_at_0(min(n0_0 + u32(r_0), N_0 - u32(1)) * row_halves_0(_S5), k_1);
            var tb_1 : i32 = i32(0);
            for(;;)
            {
                if(tb_1 < i32(1))
                {
                }
                else
                {
                    break;
                }
                dots_0[tb_1 * i32(4) + r_0] = dots_0[tb_1 * i32(4) + r_0] + xs_0[tb_1] * _S7;
                tb_1 = tb_1 + i32(1);
            }
            r_0 = r_0 + i32(1);
        }
        k_1 = k_1 + u32(64);
    }
    i_0 = i32(0);
    for(;;)
    {
        if(i_0 < i32(4))
        {
        }
        else
        {
            break;
        }
        gemv_partial_0[u32(i_0) * u32(64) + lane_0] = dots_0[i_0];
        i_0 = i_0 + i32(1);
    }
    workgroupBarrier();
    var _S8 : bool = lane_0 < u32(4);
    if(_S8)
    {
        var j_1 : u32 = u32(0);
        var total_0 : f32 = 0.0f;
        for(;;)
        {
            if(j_1 < u32(64))
            {
            }
            else
            {
                break;
            }
            var total_1 : f32 = total_0 + gemv_partial_0[lane_0 * u32(64) + j_1];
            j_1 = j_1 + u32(1);
            total_0 = total_1;
        }
        gemv_total_0[lane_0] = total_0;
    }
    workgroupBarrier();
    if(_S8)
    {
        var tb_2 : u32 = lane_0 / u32(4);
        var t_0 : u32 = _S4 + tb_2;
        var n_0 : u32 = n0_0 + (lane_0 - tb_2 * u32(4));
        var _S9 : bool;
        if(t_0 < T_0)
        {
            _S9 = n_0 < N_0;
        }
        else
        {
            _S9 = false;
        }
        if(_S9)
        {
            result_0[t_0 * params_0.out_stride_0 + n_0] = finish_0(gemv_total_0[lane_0], 0.0f, 1.0f, t_0, n_0);
        }
    }
    return;
}

@compute
@workgroup_size(64, 1, 1)
fn linear__gemv__q5_0(@builtin(workgroup_id) group_1 : vec3<u32>, @builtin(local_invocation_id) local_0 : vec3<u32>)
{
    gemv_0(group_1, local_0.x);
    return;
}


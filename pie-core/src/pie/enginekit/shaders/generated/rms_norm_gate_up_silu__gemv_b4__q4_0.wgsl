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
@binding(1) @group(0) var<storage, read> x_0 : array<f32>;

@binding(4) @group(0) var<storage, read> norm_weight_0 : array<f32>;

@binding(6) @group(0) var<storage, read_write> result_0 : array<f32>;

@binding(10) @group(0) var<storage, read> weight_words_0 : array<u32>;

fn WeightWords_word_0( index_0 : u32) -> u32
{
    return weight_words_0[index_0];
}

fn byte_at_0( byte_0 : u32) -> u32
{
    return ((((WeightWords_word_0((byte_0 >> (u32(2))))) >> ((((byte_0 & (u32(3)))) * u32(8))))) & (u32(255)));
}

fn half_at_0( half_0 : u32) -> f32
{
    return (unpack2x16float((((((WeightWords_word_0((half_0 >> (u32(1))))) >> ((((half_0 & (u32(1)))) * u32(16))))) & (u32(65535))))).x);
}

fn block_halves_0() -> u32
{
    return u32(9);
}

fn stored_at_0( row_0 : u32,  k_0 : u32) -> f32
{
    var block_0 : u32 = row_0 + k_0 / u32(32) * block_halves_0();
    var j_0 : u32 = k_0 % u32(32);
    var _S1 : f32 = half_at_0(block_0);
    var _S2 : u32 = byte_at_0(u32(2) * block_0 + u32(2) + ((j_0 & (u32(15)))));
    var _S3 : i32;
    if(j_0 >= u32(16))
    {
        _S3 = i32(4);
    }
    else
    {
        _S3 = i32(0);
    }
    var q_0 : f32 = f32((((_S2 >> (u32(_S3)))) & (u32(15))));
    return _S1 * (q_0 - 8.0f);
}

fn row_halves_0( columns_0 : u32) -> u32
{
    return columns_0 / u32(32) * block_halves_0();
}

fn finish_0( dot_0 : f32,  up_0 : f32,  inverse_rms_0 : f32,  token_0 : u32,  column_0 : u32) -> f32
{
    var gate_0 : f32 = dot_0 * inverse_rms_0;
    return gate_0 / (1.0f + exp(- gate_0)) * (up_0 * inverse_rms_0);
}

var<workgroup> gemv_partial_0 : array<f32, i32(2560)>;

var<workgroup> gemv_total_0 : array<f32, i32(40)>;

fn inverse_rms_1( squares_0 : f32) -> f32
{
    return 1.0f / sqrt(squares_0 / f32(params_0.inputs_0) + params_0.eps_0);
}

fn gemv_0( group_0 : vec3<u32>,  lane_0 : u32)
{
    var n0_0 : u32 = group_0.x * u32(4);
    var t0_0 : u32 = group_0.y * u32(4);
    var _S4 : u32 = params_0.inputs_0;
    var N_0 : u32 = params_0.outputs_0;
    var T_0 : u32 = params_0.tokens_0;
    var dots_0 : array<f32, i32(16)>;
    var ups_0 : array<f32, i32(16)>;
    var squares_1 : array<f32, i32(4)>;
    var i_0 : i32 = i32(0);
    for(;;)
    {
        if(i_0 < i32(16))
        {
        }
        else
        {
            break;
        }
        dots_0[i_0] = 0.0f;
        ups_0[i_0] = 0.0f;
        i_0 = i_0 + i32(1);
    }
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
        squares_1[tb_0] = 0.0f;
        tb_0 = tb_0 + i32(1);
    }
    var k_1 : u32 = lane_0;
    for(;;)
    {
        if(k_1 < _S4)
        {
        }
        else
        {
            break;
        }
        var xs_0 : array<f32, i32(4)>;
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
            var _S5 : f32 = x_0[min(t0_0 + u32(tb_0), T_0 - u32(1)) * _S4 + k_1];
            xs_0[tb_0] = _S5;
            squares_1[tb_0] = squares_1[tb_0] + _S5 * _S5;
            tb_0 = tb_0 + i32(1);
        }
        var _S6 : f32 = norm_weight_0[k_1];
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
            var _S7 : u32 = min(n0_0 + u32(r_0), N_0 - u32(1));
            var _S8 : u32 = row_halves_0(_S4);
            var _S9 : f32 = stored_at_0(_S7 * _S8, k_1) * _S6;
            var _S10 : f32 = stored_at_0((_S7 + N_0) * _S8, k_1) * _S6;
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
                var _S11 : i32 = tb_1 * i32(4) + r_0;
                dots_0[_S11] = dots_0[_S11] + xs_0[tb_1] * _S9;
                ups_0[_S11] = ups_0[_S11] + xs_0[tb_1] * _S10;
                tb_1 = tb_1 + i32(1);
            }
            r_0 = r_0 + i32(1);
        }
        k_1 = k_1 + u32(64);
    }
    i_0 = i32(0);
    for(;;)
    {
        if(i_0 < i32(16))
        {
        }
        else
        {
            break;
        }
        gemv_partial_0[u32(i_0) * u32(64) + lane_0] = dots_0[i_0];
        gemv_partial_0[u32(i32(16) + i_0) * u32(64) + lane_0] = ups_0[i_0];
        i_0 = i_0 + i32(1);
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
        gemv_partial_0[(u32(32) + u32(tb_0)) * u32(64) + lane_0] = squares_1[tb_0];
        tb_0 = tb_0 + i32(1);
    }
    workgroupBarrier();
    if(lane_0 < u32(36))
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
    if(lane_0 < u32(16))
    {
        var tb_2 : u32 = lane_0 / u32(4);
        var t_0 : u32 = t0_0 + tb_2;
        var n_0 : u32 = n0_0 + (lane_0 - tb_2 * u32(4));
        var _S12 : bool;
        if(t_0 < T_0)
        {
            _S12 = n_0 < N_0;
        }
        else
        {
            _S12 = false;
        }
        if(_S12)
        {
            result_0[t_0 * params_0.out_stride_0 + n_0] = finish_0(gemv_total_0[lane_0], gemv_total_0[u32(16) + lane_0], inverse_rms_1(gemv_total_0[u32(32) + tb_2]), t_0, n_0);
        }
    }
    return;
}

@compute
@workgroup_size(64, 1, 1)
fn rms_norm_gate_up_silu__gemv_b4__q4_0(@builtin(workgroup_id) group_1 : vec3<u32>, @builtin(local_invocation_id) local_0 : vec3<u32>)
{
    gemv_0(group_1, local_0.x);
    return;
}


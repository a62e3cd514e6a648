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

@binding(2) @group(0) var<storage, read> weight_0 : array<f32>;

@binding(1) @group(0) var<storage, read> x_0 : array<f32>;

@binding(4) @group(0) var<storage, read> norm_weight_0 : array<f32>;

@binding(6) @group(0) var<storage, read_write> result_0 : array<f32>;

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
    var _S2 : u32 = params_0.inputs_0;
    var N_0 : u32 = params_0.outputs_0;
    var T_0 : u32 = params_0.tokens_0;
    var dots_0 : array<f32, i32(16)>;
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
    var k_0 : u32 = lane_0;
    for(;;)
    {
        if(k_0 < _S2)
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
            var _S3 : f32 = x_0[min(t0_0 + u32(tb_0), T_0 - u32(1)) * _S2 + k_0];
            xs_0[tb_0] = _S3;
            squares_1[tb_0] = squares_1[tb_0] + _S3 * _S3;
            tb_0 = tb_0 + i32(1);
        }
        var _S4 : f32 = norm_weight_0[k_0];
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
            var _S5 : f32 = weight_0[min(n0_0 + u32(r_0), N_0 - u32(1)) * _S2 + k_0] * _S4;
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
                dots_0[tb_1 * i32(4) + r_0] = dots_0[tb_1 * i32(4) + r_0] + xs_0[tb_1] * _S5;
                tb_1 = tb_1 + i32(1);
            }
            r_0 = r_0 + i32(1);
        }
        k_0 = k_0 + u32(64);
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
        gemv_partial_0[(u32(16) + u32(tb_0)) * u32(64) + lane_0] = squares_1[tb_0];
        tb_0 = tb_0 + i32(1);
    }
    workgroupBarrier();
    if(lane_0 < u32(20))
    {
        var j_0 : u32 = u32(0);
        var total_0 : f32 = 0.0f;
        for(;;)
        {
            if(j_0 < u32(64))
            {
            }
            else
            {
                break;
            }
            var total_1 : f32 = total_0 + gemv_partial_0[lane_0 * u32(64) + j_0];
            j_0 = j_0 + u32(1);
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
        var _S6 : bool;
        if(t_0 < T_0)
        {
            _S6 = n_0 < N_0;
        }
        else
        {
            _S6 = false;
        }
        if(_S6)
        {
            result_0[t_0 * params_0.out_stride_0 + n_0] = finish_0(gemv_total_0[lane_0], 0.0f, inverse_rms_1(gemv_total_0[u32(16) + tb_2]), t_0, n_0);
        }
    }
    return;
}

@compute
@workgroup_size(64, 1, 1)
fn rms_norm_linear__gemv_b4(@builtin(workgroup_id) group_1 : vec3<u32>, @builtin(local_invocation_id) local_0 : vec3<u32>)
{
    gemv_0(group_1, local_0.x);
    return;
}


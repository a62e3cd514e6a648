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

@binding(6) @group(0) var<storage, read_write> result_0 : array<f32>;

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

var<workgroup> tile_x_0 : array<f32, i32(1024)>;

var<workgroup> tile_w_0 : array<f32, i32(1024)>;

fn tile_0( group_0 : vec3<u32>,  lane_0 : u32)
{
    var tm_0 : i32;
    var tn_0 : i32;
    var value_0 : f32;
    var inside_0 : bool;
    var m0_0 : u32 = group_0.y * u32(64);
    var n0_0 : u32 = group_0.x * u32(64);
    var _S1 : u32 = params_0.inputs_0;
    var _S2 : u32 = params_0.outputs_0;
    var _S3 : u32 = params_0.tokens_0;
    var load_row_0 : u32 = lane_0 / u32(4);
    var _S4 : u32 = lane_0 % u32(4) * u32(4);
    var load_col_0 : u32 = lane_0 / u32(4);
    var _S5 : u32 = m0_0 + load_row_0;
    var _S6 : u32 = n0_0 + load_col_0;
    var _S7 : u32 = lane_0 / u32(16);
    var _S8 : u32 = lane_0 % u32(16);
    var dots_0 : array<f32, i32(16)>;
    var ups_0 : array<f32, i32(16)>;
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
    var k0_0 : u32 = u32(0);
    var squares_0 : f32 = 0.0f;
    for(;;)
    {
        if(k0_0 < _S1)
        {
        }
        else
        {
            break;
        }
        var e_0 : u32 = u32(0);
        for(;;)
        {
            if(e_0 < u32(4))
            {
            }
            else
            {
                break;
            }
            var k_0 : u32 = k0_0 + _S4 + e_0;
            if(_S5 < _S3)
            {
                inside_0 = k_0 < _S1;
            }
            else
            {
                inside_0 = false;
            }
            if(inside_0)
            {
                value_0 = x_0[_S5 * _S1 + k_0];
            }
            else
            {
                value_0 = 0.0f;
            }
            var squares_1 : f32 = squares_0 + value_0 * value_0;
            tile_x_0[(_S4 + e_0) * u32(64) + load_row_0] = value_0;
            e_0 = e_0 + u32(1);
            squares_0 = squares_1;
        }
        var e_1 : u32 = u32(0);
        for(;;)
        {
            if(e_1 < u32(4))
            {
            }
            else
            {
                break;
            }
            var k_1 : u32 = k0_0 + _S4 + e_1;
            if(_S6 < _S2)
            {
                inside_0 = k_1 < _S1;
            }
            else
            {
                inside_0 = false;
            }
            if(inside_0)
            {
                value_0 = weight_0[_S6 * _S1 + k_1];
            }
            else
            {
                value_0 = 0.0f;
            }
            tile_w_0[(_S4 + e_1) * u32(64) + load_col_0] = value_0;
            e_1 = e_1 + u32(1);
        }
        workgroupBarrier();
        var kk_0 : u32 = u32(0);
        for(;;)
        {
            if(kk_0 < u32(16))
            {
            }
            else
            {
                break;
            }
            var a_0 : array<f32, i32(4)>;
            var b_0 : array<f32, i32(4)>;
            tm_0 = i32(0);
            for(;;)
            {
                if(tm_0 < i32(4))
                {
                }
                else
                {
                    break;
                }
                a_0[tm_0] = tile_x_0[kk_0 * u32(64) + _S7 + u32(tm_0 * i32(16))];
                tm_0 = tm_0 + i32(1);
            }
            tn_0 = i32(0);
            for(;;)
            {
                if(tn_0 < i32(4))
                {
                }
                else
                {
                    break;
                }
                b_0[tn_0] = tile_w_0[kk_0 * u32(64) + _S8 + u32(tn_0) * u32(16)];
                tn_0 = tn_0 + i32(1);
            }
            var tm_1 : i32 = i32(0);
            for(;;)
            {
                if(tm_1 < i32(4))
                {
                }
                else
                {
                    break;
                }
                var tn_1 : i32 = i32(0);
                for(;;)
                {
                    if(tn_1 < i32(4))
                    {
                    }
                    else
                    {
                        break;
                    }
                    dots_0[tm_1 * i32(4) + tn_1] = dots_0[tm_1 * i32(4) + tn_1] + a_0[tm_1] * b_0[tn_1];
                    tn_1 = tn_1 + i32(1);
                }
                tm_1 = tm_1 + i32(1);
            }
            kk_0 = kk_0 + u32(1);
        }
        workgroupBarrier();
        k0_0 = k0_0 + u32(16);
    }
    tm_0 = i32(0);
    for(;;)
    {
        if(tm_0 < i32(4))
        {
        }
        else
        {
            break;
        }
        var t_0 : u32 = m0_0 + (_S7 + u32(tm_0 * i32(16)));
        if(t_0 >= _S3)
        {
            tm_0 = tm_0 + i32(1);
            continue;
        }
        tn_0 = i32(0);
        for(;;)
        {
            if(tn_0 < i32(4))
            {
            }
            else
            {
                break;
            }
            var n_0 : u32 = n0_0 + _S8 + u32(tn_0) * u32(16);
            if(n_0 < _S2)
            {
                var _S9 : i32 = tm_0 * i32(4) + tn_0;
                result_0[t_0 * params_0.out_stride_0 + n_0] = finish_0(dots_0[_S9], ups_0[_S9], 1.0f, t_0, n_0);
            }
            tn_0 = tn_0 + i32(1);
        }
        tm_0 = tm_0 + i32(1);
    }
    return;
}

@compute
@workgroup_size(256, 1, 1)
fn linear__tile64(@builtin(workgroup_id) group_1 : vec3<u32>, @builtin(local_invocation_id) local_0 : vec3<u32>)
{
    tile_0(group_1, local_0.x);
    return;
}


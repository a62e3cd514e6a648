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
@binding(5) @group(0) var<storage, read> residual_0 : array<f32>;

@binding(8) @group(0) var<storage, read> weight4_0 : array<vec4<f32>>;

@binding(7) @group(0) var<storage, read> x4_0 : array<vec4<f32>>;

@binding(6) @group(0) var<storage, read_write> result_0 : array<f32>;

fn finish_0( dot_0 : f32,  up_0 : f32,  inverse_rms_0 : f32,  token_0 : u32,  column_0 : u32) -> f32
{
    return dot_0 + residual_0[token_0 * params_0.out_stride_0 + column_0];
}

fn rows_0( group_0 : vec3<u32>,  lane_0 : u32)
{
    var N_0 : u32 = params_0.outputs_0;
    var _S1 : u32 = params_0.tokens_0;
    var _S2 : u32 = params_0.inputs_0 / u32(4);
    var n_0 : u32 = group_0.x * u32(64) + lane_0;
    var _S3 : u32 = group_0.y;
    var _S4 : u32 = min(n_0, params_0.outputs_0 - u32(1));
    var dots_0 : array<f32, i32(1)>;
    var ups_0 : array<f32, i32(1)>;
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
        dots_0[tb_0] = 0.0f;
        ups_0[tb_0] = 0.0f;
        tb_0 = tb_0 + i32(1);
    }
    var k_0 : u32 = u32(0);
    for(;;)
    {
        if(k_0 < _S2)
        {
        }
        else
        {
            break;
        }
        var _S5 : vec4<f32> = weight4_0[_S4 * _S2 + k_0];
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
            dots_0[tb_0] = dots_0[tb_0] + dot(x4_0[min(_S3 + u32(tb_0), _S1 - u32(1)) * _S2 + k_0], _S5);
            tb_0 = tb_0 + i32(1);
        }
        k_0 = k_0 + u32(1);
    }
    if(n_0 >= N_0)
    {
        return;
    }
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
        var t_0 : u32 = _S3 + u32(tb_0);
        if(t_0 < _S1)
        {
            result_0[t_0 * params_0.out_stride_0 + n_0] = finish_0(dots_0[tb_0], ups_0[tb_0], 1.0f, t_0, n_0);
        }
        tb_0 = tb_0 + i32(1);
    }
    return;
}

@compute
@workgroup_size(64, 1, 1)
fn linear_add__rows(@builtin(workgroup_id) group_1 : vec3<u32>, @builtin(local_invocation_id) local_0 : vec3<u32>)
{
    rows_0(group_1, local_0.x);
    return;
}


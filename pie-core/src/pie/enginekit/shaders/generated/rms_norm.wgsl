struct NormParams_std140_0
{
    @align(16) rows_0 : u32,
    @align(4) columns_0 : u32,
    @align(8) eps_0 : f32,
};

@binding(0) @group(0) var<uniform> params_0 : NormParams_std140_0;
@binding(1) @group(0) var<storage, read> x_0 : array<f32>;

@binding(3) @group(0) var<storage, read_write> result_0 : array<f32>;

@binding(2) @group(0) var<storage, read> weight_0 : array<f32>;

var<workgroup> g_values_0 : array<f32, i32(256)>;

fn group_sum_0( value_0 : f32,  lane_0 : u32,  size_0 : u32) -> f32
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
            g_values_0[lane_0] = g_values_0[lane_0] + g_values_0[lane_0 + stride_0];
        }
        workgroupBarrier();
        stride_0 = (stride_0 >> (u32(1)));
    }
    var total_0 : f32 = g_values_0[i32(0)];
    workgroupBarrier();
    return total_0;
}

@compute
@workgroup_size(256, 1, 1)
fn rms_norm(@builtin(workgroup_id) group_0 : vec3<u32>, @builtin(local_invocation_id) local_0 : vec3<u32>)
{
    var lane_1 : u32 = local_0.x;
    var columns_1 : u32 = params_0.columns_0;
    var _S1 : u32 = group_0.x * params_0.columns_0;
    var c_0 : u32 = lane_1;
    var squares_0 : f32 = 0.0f;
    for(;;)
    {
        if(c_0 < columns_1)
        {
        }
        else
        {
            break;
        }
        var value_1 : f32 = x_0[_S1 + c_0];
        var squares_1 : f32 = squares_0 + value_1 * value_1;
        c_0 = c_0 + u32(256);
        squares_0 = squares_1;
    }
    var total_1 : f32 = group_sum_0(squares_0, lane_1, u32(256));
    var _S2 : f32 = 1.0f / sqrt(total_1 / f32(columns_1) + params_0.eps_0);
    c_0 = lane_1;
    for(;;)
    {
        if(c_0 < columns_1)
        {
        }
        else
        {
            break;
        }
        var _S3 : u32 = _S1 + c_0;
        result_0[_S3] = x_0[_S3] * _S2 * weight_0[c_0];
        c_0 = c_0 + u32(256);
    }
    return;
}



fn _slang_getInfinity(positive: bool) -> f32
{
    let a = select(f32(-1.0), f32(1.0), positive);
    let b = f32(0.0);
    return a / b;
}

struct SoftmaxParams_std140_0
{
    @align(16) rows_0 : u32,
    @align(4) columns_0 : u32,
    @align(8) inv_temperature_0 : f32,
};

@binding(0) @group(0) var<uniform> params_0 : SoftmaxParams_std140_0;
@binding(1) @group(0) var<storage, read> x_0 : array<f32>;

@binding(2) @group(0) var<storage, read_write> result_0 : array<f32>;

var<workgroup> g_values_0 : array<f32, i32(256)>;

fn group_max_0( value_0 : f32,  lane_0 : u32,  size_0 : u32) -> f32
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
            g_values_0[lane_0] = max(g_values_0[lane_0], g_values_0[lane_0 + stride_0]);
        }
        workgroupBarrier();
        stride_0 = (stride_0 >> (u32(1)));
    }
    var best_0 : f32 = g_values_0[i32(0)];
    workgroupBarrier();
    return best_0;
}

fn group_sum_0( value_1 : f32,  lane_1 : u32,  size_1 : u32) -> f32
{
    g_values_0[lane_1] = value_1;
    workgroupBarrier();
    var stride_1 : u32 = size_1 / u32(2);
    for(;;)
    {
        if(stride_1 > u32(0))
        {
        }
        else
        {
            break;
        }
        if(lane_1 < stride_1)
        {
            g_values_0[lane_1] = g_values_0[lane_1] + g_values_0[lane_1 + stride_1];
        }
        workgroupBarrier();
        stride_1 = (stride_1 >> (u32(1)));
    }
    var total_0 : f32 = g_values_0[i32(0)];
    workgroupBarrier();
    return total_0;
}

@compute
@workgroup_size(256, 1, 1)
fn softmax(@builtin(workgroup_id) group_0 : vec3<u32>, @builtin(local_invocation_id) local_0 : vec3<u32>)
{
    var lane_2 : u32 = local_0.x;
    var _S1 : u32 = group_0.x * params_0.columns_0;
    var _S2 : f32 = params_0.inv_temperature_0;
    var largest_0 : f32 = _slang_getInfinity(false);
    var c_0 : u32 = lane_2;
    for(;;)
    {
        if(c_0 < (params_0.columns_0))
        {
        }
        else
        {
            break;
        }
        var _S3 : f32 = max(largest_0, x_0[_S1 + c_0] * _S2);
        var c_1 : u32 = c_0 + u32(256);
        largest_0 = _S3;
        c_0 = c_1;
    }
    var _S4 : f32 = group_max_0(largest_0, lane_2, u32(256));
    c_0 = lane_2;
    var total_1 : f32 = 0.0f;
    for(;;)
    {
        if(c_0 < (params_0.columns_0))
        {
        }
        else
        {
            break;
        }
        var total_2 : f32 = total_1 + exp(x_0[_S1 + c_0] * _S2 - _S4);
        c_0 = c_0 + u32(256);
        total_1 = total_2;
    }
    var total_3 : f32 = group_sum_0(total_1, lane_2, u32(256));
    var _S5 : f32 = 1.0f / total_3;
    c_0 = lane_2;
    for(;;)
    {
        if(c_0 < (params_0.columns_0))
        {
        }
        else
        {
            break;
        }
        var _S6 : u32 = _S1 + c_0;
        result_0[_S6] = exp(x_0[_S6] * _S2 - _S4) * _S5;
        c_0 = c_0 + u32(256);
    }
    return;
}


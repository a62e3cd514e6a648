
fn _slang_getInfinity(positive: bool) -> f32
{
    let a = select(f32(-1.0), f32(1.0), positive);
    let b = f32(0.0);
    return a / b;
}

struct TopKParams_std140_0
{
    @align(16) rows_0 : u32,
    @align(4) columns_0 : u32,
    @align(8) k_0 : u32,
    @align(4) first_0 : u32,
};

@binding(0) @group(0) var<uniform> params_0 : TopKParams_std140_0;
@binding(2) @group(0) var<storage, read_write> values_0 : array<f32>;

@binding(3) @group(0) var<storage, read_write> indices_0 : array<i32>;

@binding(1) @group(0) var<storage, read> x_0 : array<f32>;

var<workgroup> g_values_0 : array<f32, i32(256)>;

var<workgroup> g_indices_0 : array<u32, i32(256)>;

fn group_argmax_0( value_0 : f32,  index_0 : u32,  lane_0 : u32,  size_0 : u32) -> u32
{
    g_values_0[lane_0] = value_0;
    g_indices_0[lane_0] = index_0;
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
            var _S1 : u32 = lane_0 + stride_0;
            var other_0 : f32 = g_values_0[_S1];
            var other_index_0 : u32 = g_indices_0[_S1];
            var _S2 : bool;
            if((g_values_0[_S1]) > (g_values_0[lane_0]))
            {
                _S2 = true;
            }
            else
            {
                if(other_0 == (g_values_0[lane_0]))
                {
                    _S2 = other_index_0 < (g_indices_0[lane_0]);
                }
                else
                {
                    _S2 = false;
                }
            }
            if(_S2)
            {
                g_values_0[lane_0] = other_0;
                g_indices_0[lane_0] = other_index_0;
            }
        }
        workgroupBarrier();
        stride_0 = (stride_0 >> (u32(1)));
    }
    var best_0 : u32 = g_indices_0[i32(0)];
    workgroupBarrier();
    return best_0;
}

@compute
@workgroup_size(256, 1, 1)
fn top_k(@builtin(workgroup_id) group_0 : vec3<u32>, @builtin(local_invocation_id) local_0 : vec3<u32>)
{
    var row_0 : u32 = group_0.x;
    var _S3 : u32 = local_0.x;
    var _S4 : u32 = row_0 * params_0.columns_0;
    var previous_0 : f32;
    var previous_index_0 : u32;
    if((params_0.first_0) > u32(0))
    {
        var _S5 : u32 = u32(indices_0[row_0 * params_0.k_0 + params_0.first_0 - u32(1)]);
        previous_0 = values_0[row_0 * params_0.k_0 + params_0.first_0 - u32(1)];
        previous_index_0 = _S5;
    }
    else
    {
        previous_0 = _slang_getInfinity(true);
        previous_index_0 = u32(4294967295);
    }
    var round_0 : u32 = params_0.first_0;
    for(;;)
    {
        if(round_0 < (params_0.k_0))
        {
        }
        else
        {
            break;
        }
        var best_index_0 : u32 = u32(4294967295);
        var best_1 : f32 = _slang_getInfinity(false);
        var c_0 : u32 = _S3;
        for(;;)
        {
            if(c_0 < (params_0.columns_0))
            {
            }
            else
            {
                break;
            }
            var value_1 : f32 = x_0[_S4 + c_0];
            var _S6 : bool;
            if(round_0 == u32(0))
            {
                _S6 = true;
            }
            else
            {
                _S6 = value_1 < previous_0;
            }
            var after_0 : bool;
            if(_S6)
            {
                after_0 = true;
            }
            else
            {
                if(value_1 == previous_0)
                {
                    after_0 = c_0 > previous_index_0;
                }
                else
                {
                    after_0 = false;
                }
            }
            var _S7 : bool;
            if(after_0)
            {
                if(best_index_0 == u32(4294967295))
                {
                    _S7 = true;
                }
                else
                {
                    _S7 = value_1 > best_1;
                }
            }
            else
            {
                _S7 = false;
            }
            if(_S7)
            {
                best_index_0 = c_0;
                best_1 = value_1;
            }
            c_0 = c_0 + u32(256);
        }
        var winner_0 : u32 = group_argmax_0(best_1, best_index_0, _S3, u32(256));
        var winner_1 : u32;
        if(winner_0 == u32(4294967295))
        {
            winner_1 = u32(0);
        }
        else
        {
            winner_1 = winner_0;
        }
        var previous_1 : f32 = x_0[_S4 + winner_1];
        if(_S3 == u32(0))
        {
            values_0[row_0 * params_0.k_0 + round_0] = previous_1;
            indices_0[row_0 * params_0.k_0 + round_0] = i32(winner_1);
        }
        var _S8 : u32 = round_0 + u32(1);
        previous_0 = previous_1;
        previous_index_0 = winner_1;
        round_0 = _S8;
    }
    return;
}


struct SiluMulParams_std140_0
{
    @align(16) rows_0 : u32,
    @align(4) half_width_0 : u32,
    @align(8) groups_x_0 : u32,
};

@binding(0) @group(0) var<uniform> params_0 : SiluMulParams_std140_0;
@binding(1) @group(0) var<storage, read> gate_up_0 : array<f32>;

@binding(2) @group(0) var<storage, read_write> result_0 : array<f32>;

fn flat_index_0( group_0 : vec3<u32>,  lane_0 : u32,  groups_x_1 : u32,  group_size_0 : u32) -> u32
{
    return (group_0.y * groups_x_1 + group_0.x) * group_size_0 + lane_0;
}

@compute
@workgroup_size(256, 1, 1)
fn silu_mul(@builtin(workgroup_id) group_1 : vec3<u32>, @builtin(local_invocation_id) local_0 : vec3<u32>)
{
    var i_0 : u32 = flat_index_0(group_1, local_0.x, params_0.groups_x_0, u32(256));
    var half_width_1 : u32 = params_0.half_width_0;
    if(i_0 >= (params_0.rows_0 * params_0.half_width_0))
    {
        return;
    }
    var row_0 : u32 = i_0 / half_width_1;
    var column_0 : u32 = i_0 - row_0 * half_width_1;
    var _S1 : u32 = row_0 * u32(2) * half_width_1;
    var gate_0 : f32 = gate_up_0[_S1 + column_0];
    result_0[i_0] = gate_0 / (1.0f + exp(- gate_0)) * gate_up_0[_S1 + half_width_1 + column_0];
    return;
}


struct SliceParams_std140_0
{
    @align(16) rows_0 : u32,
    @align(4) width_0 : u32,
    @align(8) start_0 : u32,
    @align(4) columns_0 : u32,
    @align(16) groups_x_0 : u32,
};

@binding(0) @group(0) var<uniform> params_0 : SliceParams_std140_0;
@binding(2) @group(0) var<storage, read_write> result_0 : array<f32>;

@binding(1) @group(0) var<storage, read> x_0 : array<f32>;

fn flat_index_0( group_0 : vec3<u32>,  lane_0 : u32,  groups_x_1 : u32,  group_size_0 : u32) -> u32
{
    return (group_0.y * groups_x_1 + group_0.x) * group_size_0 + lane_0;
}

@compute
@workgroup_size(256, 1, 1)
fn slice_columns(@builtin(workgroup_id) group_1 : vec3<u32>, @builtin(local_invocation_id) local_0 : vec3<u32>)
{
    var i_0 : u32 = flat_index_0(group_1, local_0.x, params_0.groups_x_0, u32(256));
    if(i_0 >= (params_0.rows_0 * params_0.columns_0))
    {
        return;
    }
    var row_0 : u32 = i_0 / params_0.columns_0;
    result_0[i_0] = x_0[row_0 * params_0.width_0 + params_0.start_0 + (i_0 - row_0 * params_0.columns_0)];
    return;
}


struct AddParams_std140_0
{
    @align(16) count_0 : u32,
    @align(4) groups_x_0 : u32,
};

@binding(0) @group(0) var<uniform> params_0 : AddParams_std140_0;
@binding(3) @group(0) var<storage, read_write> result_0 : array<f32>;

@binding(1) @group(0) var<storage, read> a_0 : array<f32>;

@binding(2) @group(0) var<storage, read> b_0 : array<f32>;

fn flat_index_0( group_0 : vec3<u32>,  lane_0 : u32,  groups_x_1 : u32,  group_size_0 : u32) -> u32
{
    return (group_0.y * groups_x_1 + group_0.x) * group_size_0 + lane_0;
}

@compute
@workgroup_size(256, 1, 1)
fn add(@builtin(workgroup_id) group_1 : vec3<u32>, @builtin(local_invocation_id) local_0 : vec3<u32>)
{
    var i_0 : u32 = flat_index_0(group_1, local_0.x, params_0.groups_x_0, u32(256));
    if(i_0 < (params_0.count_0))
    {
        result_0[i_0] = a_0[i_0] + b_0[i_0];
    }
    return;
}


struct AppendParams_std140_0
{
    @align(16) tokens_0 : u32,
    @align(4) kv_width_0 : u32,
    @align(8) page_size_0 : u32,
    @align(4) layer_base_0 : u32,
    @align(16) groups_x_0 : u32,
};

@binding(0) @group(0) var<uniform> params_0 : AppendParams_std140_0;
@binding(4) @group(0) var<storage, read> slots_0 : array<i32>;

@binding(1) @group(0) var<storage, read_write> pool_0 : array<f32>;

@binding(2) @group(0) var<storage, read> k_0 : array<f32>;

@binding(3) @group(0) var<storage, read> v_0 : array<f32>;

fn flat_index_0( group_0 : vec3<u32>,  lane_0 : u32,  groups_x_1 : u32,  group_size_0 : u32) -> u32
{
    return (group_0.y * groups_x_1 + group_0.x) * group_size_0 + lane_0;
}

fn append_0( group_1 : vec3<u32>,  lane_1 : u32)
{
    var i_0 : u32 = flat_index_0(group_1, lane_1, params_0.groups_x_0, u32(256));
    var _S1 : u32 = params_0.kv_width_0;
    if(i_0 >= (params_0.tokens_0 * params_0.kv_width_0))
    {
        return;
    }
    var token_0 : u32 = i_0 / _S1;
    var column_0 : u32 = i_0 - token_0 * _S1;
    var slot_0 : i32 = slots_0[token_0];
    if(slot_0 < i32(0))
    {
        return;
    }
    var _S2 : u32 = u32(slot_0);
    var page_0 : u32 = _S2 / params_0.page_size_0;
    var offset_0 : u32 = _S2 - page_0 * params_0.page_size_0;
    var key_at_0 : u32 = params_0.layer_base_0 + (page_0 * u32(2) * params_0.page_size_0 + offset_0) * _S1 + column_0;
    var value_at_0 : u32 = key_at_0 + params_0.page_size_0 * _S1;
    pool_0[key_at_0] = k_0[i_0];
    pool_0[value_at_0] = v_0[i_0];
    return;
}

@compute
@workgroup_size(256, 1, 1)
fn append_kv(@builtin(workgroup_id) group_2 : vec3<u32>, @builtin(local_invocation_id) local_0 : vec3<u32>)
{
    append_0(group_2, local_0.x);
    return;
}


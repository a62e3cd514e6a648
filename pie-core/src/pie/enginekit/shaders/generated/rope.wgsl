struct RopeParams_std140_0
{
    @align(16) tokens_0 : u32,
    @align(4) heads_0 : u32,
    @align(8) half_dim_0 : u32,
    @align(4) groups_x_0 : u32,
};

@binding(0) @group(0) var<uniform> params_0 : RopeParams_std140_0;
@binding(2) @group(0) var<storage, read> positions_0 : array<i32>;

@binding(3) @group(0) var<storage, read> inv_freq_0 : array<f32>;

@binding(1) @group(0) var<storage, read> x_0 : array<f32>;

@binding(4) @group(0) var<storage, read_write> result_0 : array<f32>;

fn flat_index_0( group_0 : vec3<u32>,  lane_0 : u32,  groups_x_1 : u32,  group_size_0 : u32) -> u32
{
    return (group_0.y * groups_x_1 + group_0.x) * group_size_0 + lane_0;
}

fn sin_cos_0( angle_0 : f32) -> vec2<f32>
{
    var j_0 : f32 = round(angle_0 * 0.63661974668502808f);
    var r_0 : f32 = angle_0 - j_0 * 1.5703125f - j_0 * 0.00048375129699707f - j_0 * 7.54979012640433211e-08f;
    var z_0 : f32 = r_0 * r_0;
    var s_0 : f32 = ((-0.00019515295571182f * z_0 + 0.00833216123282909f) * z_0 - 0.16666655242443085f) * z_0 * r_0 + r_0;
    var c_0 : f32 = ((0.00002443315679557f * z_0 - 0.00138873164542019f) * z_0 + 0.04166664555668831f) * z_0 * z_0 - 0.5f * z_0 + 1.0f;
    var quadrant_0 : i32 = (i32(j_0) & (i32(3)));
    if(quadrant_0 == i32(0))
    {
        return vec2<f32>(s_0, c_0);
    }
    if(quadrant_0 == i32(1))
    {
        return vec2<f32>(c_0, - s_0);
    }
    if(quadrant_0 == i32(2))
    {
        return vec2<f32>(- s_0, - c_0);
    }
    return vec2<f32>(- c_0, s_0);
}

@compute
@workgroup_size(256, 1, 1)
fn rope(@builtin(workgroup_id) group_1 : vec3<u32>, @builtin(local_invocation_id) local_0 : vec3<u32>)
{
    var i_0 : u32 = flat_index_0(group_1, local_0.x, params_0.groups_x_0, u32(256));
    var half_dim_1 : u32 = params_0.half_dim_0;
    var per_token_0 : u32 = params_0.heads_0 * params_0.half_dim_0;
    if(i_0 >= (params_0.tokens_0 * per_token_0))
    {
        return;
    }
    var token_0 : u32 = i_0 / per_token_0;
    var _S1 : u32 = token_0 * per_token_0;
    var within_0 : u32 = i_0 - _S1;
    var head_0 : u32 = within_0 / half_dim_1;
    var _S2 : u32 = head_0 * half_dim_1;
    var j_1 : u32 = within_0 - _S2;
    var sc_0 : vec2<f32> = sin_cos_0(f32(positions_0[token_0]) * inv_freq_0[j_1]);
    var s_1 : f32 = sc_0.x;
    var c_1 : f32 = sc_0.y;
    var base_0 : u32 = _S1 * u32(2) + _S2 * u32(2) + j_1;
    var first_0 : f32 = x_0[base_0];
    var _S3 : u32 = base_0 + half_dim_1;
    var second_0 : f32 = x_0[_S3];
    result_0[base_0] = first_0 * c_1 - second_0 * s_1;
    result_0[_S3] = second_0 * c_1 + first_0 * s_1;
    return;
}


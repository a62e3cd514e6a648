struct GatherParams_std140_0
{
    @align(16) rows_0 : u32,
    @align(4) columns_0 : u32,
    @align(8) source_rows_0 : u32,
    @align(4) first_row_0 : u32,
    @align(16) bound_rows_0 : u32,
    @align(4) groups_x_0 : u32,
};

@binding(0) @group(0) var<uniform> params_0 : GatherParams_std140_0;
@binding(2) @group(0) var<storage, read> indices_0 : array<i32>;

@binding(3) @group(0) var<storage, read_write> result_0 : array<f32>;

@binding(4) @group(0) var<storage, read> source_words_0 : array<u32>;

fn SourceWords_word_0( index_0 : u32) -> u32
{
    return source_words_0[index_0];
}

fn scale_min_0( start_0 : u32,  s_0 : u32,  scale_0 : ptr<function, f32>,  minimum_0 : ptr<function, f32>)
{
    var base_0 : u32 = (start_0 >> (u32(1)));
    var shift_0 : u32 = ((s_0 & (u32(3)))) * u32(8);
    var scales_0 : u32 = ((SourceWords_word_0(base_0 + u32(1))) >> (shift_0));
    var mins_0 : u32 = ((SourceWords_word_0(base_0 + u32(2))) >> (shift_0));
    if(s_0 < u32(4))
    {
        (*scale_0) = f32((scales_0 & (u32(63))));
        (*minimum_0) = f32((mins_0 & (u32(63))));
        return;
    }
    var low_0 : u32 = ((SourceWords_word_0(base_0 + u32(3))) >> (shift_0));
    (*scale_0) = f32((((low_0 & (u32(15)))) | (((((scales_0 >> (u32(2)))) & (u32(48)))))));
    (*minimum_0) = f32((((((low_0 >> (u32(4)))) & (u32(15)))) | (((((mins_0 >> (u32(2)))) & (u32(48)))))));
    return;
}

fn byte_at_0( byte_0 : u32) -> u32
{
    return ((((SourceWords_word_0((byte_0 >> (u32(2))))) >> ((((byte_0 & (u32(3)))) * u32(8))))) & (u32(255)));
}

fn half_at_0( half_0 : u32) -> f32
{
    return (unpack2x16float((((((SourceWords_word_0((half_0 >> (u32(1))))) >> ((((half_0 & (u32(1)))) * u32(16))))) & (u32(65535))))).x);
}

fn super_block_at_0( start_1 : u32,  e_0 : u32) -> f32
{
    var s_1 : u32 = e_0 / u32(32);
    var l_0 : u32 = e_0 % u32(32);
    var first_0 : u32 = u32(2) * start_1;
    var scale_1 : f32;
    var minimum_1 : f32;
    scale_min_0(start_1, s_1, &(scale_1), &(minimum_1));
    return half_at_0(start_1) * scale_1 * f32(((((((byte_at_0(first_0 + u32(48) + u32(32) * (s_1 / u32(2)) + l_0)) >> ((u32(4) * ((s_1 & (u32(1)))))))) & (u32(15)))) | ((((((((byte_at_0(first_0 + u32(16) + l_0)) >> (s_1))) & (u32(1)))) << (u32(4))))))) - half_at_0(start_1 + u32(1)) * minimum_1;
}

fn block_halves_0() -> u32
{
    return u32(88);
}

fn stored_at_0( row_0 : u32,  k_0 : u32) -> f32
{
    return super_block_at_0(row_0 + k_0 / u32(256) * block_halves_0(), k_0 % u32(256));
}

fn row_halves_0( columns_1 : u32) -> u32
{
    return columns_1 / u32(256) * block_halves_0();
}

fn flat_index_0( group_0 : vec3<u32>,  lane_0 : u32,  groups_x_1 : u32,  group_size_0 : u32) -> u32
{
    return (group_0.y * groups_x_1 + group_0.x) * group_size_0 + lane_0;
}

fn gather_0( group_1 : vec3<u32>,  lane_1 : u32)
{
    var i_0 : u32 = flat_index_0(group_1, lane_1, params_0.groups_x_0, u32(256));
    if(i_0 >= (params_0.rows_0 * params_0.columns_0))
    {
        return;
    }
    var row_1 : u32 = i_0 / params_0.columns_0;
    var column_0 : u32 = i_0 - row_1 * params_0.columns_0;
    var index_1 : i32 = indices_0[row_1];
    var inside_0 : bool;
    if(index_1 >= i32(0))
    {
        inside_0 = u32(index_1) < (params_0.source_rows_0);
    }
    else
    {
        inside_0 = false;
    }
    var bound_0 : u32 = u32(index_1) - params_0.first_row_0;
    var _S1 : bool;
    if(inside_0)
    {
        _S1 = bound_0 >= (params_0.bound_rows_0);
    }
    else
    {
        _S1 = false;
    }
    if(_S1)
    {
        _S1 = true;
    }
    else
    {
        if(!inside_0)
        {
            _S1 = (params_0.first_row_0) != u32(0);
        }
        else
        {
            _S1 = false;
        }
    }
    if(_S1)
    {
        return;
    }
    var value_0 : f32;
    if(inside_0)
    {
        value_0 = stored_at_0(bound_0 * row_halves_0(params_0.columns_0), column_0);
    }
    else
    {
        value_0 = 0.0f;
    }
    result_0[i_0] = value_0;
    return;
}

@compute
@workgroup_size(256, 1, 1)
fn gather_rows__q5_k(@builtin(workgroup_id) group_2 : vec3<u32>, @builtin(local_invocation_id) local_0 : vec3<u32>)
{
    gather_0(group_2, local_0.x);
    return;
}


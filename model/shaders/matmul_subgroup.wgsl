// The matmul's staging through subgroup shuffles: lane l of a subgroup
// loads vec4 column l % 8 of the block for each of the tile's R rows, and a
// row's column j is lane j's copy, shuffled to every lane. No workgroup
// memory, no barriers, and each invocation loads R vec4s per block instead
// of reading 8 R from workgroup memory. Needs subgroups of at least 8 lanes.

var<private> xs: array<vec4<f32>, R>;

fn stage(t0: u32, kb: u32, lid: u32, sid: u32) {
    for (var r = 0u; r < R; r++) {
        var x = vec4<f32>(0.0);
        if t0 + r < p.m {
            x = a[(t0 + r) * (p.lda / 4u) + kb * 8u + sid % 8u];
        }
        xs[r] = x;
    }
}

fn unstage() {}

// Row r of the tile at vec4 column j of the block.
fn row(r: u32, j: u32) -> vec4<f32> {
    return subgroupShuffle(xs[r], j);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>, @builtin(subgroup_invocation_id) sid: u32) {
    run(wid, lid, sid);
}

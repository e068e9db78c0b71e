// The matmul's staging through workgroup memory: the workgroup copies the
// tile's R rows of the current block into `tile`, and every invocation reads
// them from there. Needs no feature.

// The tile's R rows of the current block: R x 8 vec4s (rows past m are 0).
var<workgroup> tile: array<vec4<f32>, R * 8u>;

fn stage(t0: u32, kb: u32, lid: u32, sid: u32) {
    for (var i = lid; i < R * 8u; i += WG) {
        let r = t0 + i / 8u;
        var x = vec4<f32>(0.0);
        if r < p.m {
            x = a[r * (p.lda / 4u) + kb * 8u + i % 8u];
        }
        tile[i] = x;
    }
    workgroupBarrier();
}

fn unstage() {
    workgroupBarrier();
}

// Row r of the tile at vec4 column j of the block.
fn row(r: u32, j: u32) -> vec4<f32> {
    return tile[r * 8u + j];
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    run(wid, lid, 0u);
}

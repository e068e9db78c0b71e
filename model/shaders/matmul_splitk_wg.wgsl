// The split-K matmul's reduction through workgroup memory: every lane's n
// sums into `red`, then a tree of log2(64) halvings. Needs no feature.

fn reduce(s: ptr<function, array<f32, SUMS>>, n: u32, lid: u32, sid: u32, sgs: u32) {
    for (var i = 0u; i < n; i++) {
        red[i * WG + lid] = (*s)[i];
    }
    for (var half = WG / 2u; half > 0u; half >>= 1u) {
        workgroupBarrier();
        if lid < half {
            for (var i = 0u; i < n; i++) {
                red[i * WG + lid] += red[i * WG + lid + half];
            }
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    run(wid, nwg, lid, 0u, 1u);
}

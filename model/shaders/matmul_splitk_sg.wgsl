// The split-K matmul's reduction through subgroups: subgroupAdd sums each
// subgroup's lanes, its first lane writes the sum into `red` (the others
// zeros), and lane i < n adds row i's 64 entries. Correct whatever lanes
// a subgroup holds, and one barrier pair instead of a tree's six. Needs
// `Features::SUBGROUP`.

fn reduce(s: ptr<function, array<f32, SUMS>>, n: u32, lid: u32, sid: u32, sgs: u32) {
    for (var i = 0u; i < n; i++) {
        let t = subgroupAdd((*s)[i]);
        red[i * WG + lid] = select(0.0, t, sid == 0u);
    }
    workgroupBarrier();
    if lid < n {
        var t = 0.0;
        for (var j = 0u; j < WG; j++) {
            t += red[lid * WG + j];
        }
        red[lid * WG] = t;
    }
    workgroupBarrier();
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32, @builtin(subgroup_invocation_id) sid: u32, @builtin(subgroup_size) sgs: u32) {
    run(wid, nwg, lid, sid, sgs);
}

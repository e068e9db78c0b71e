// The split-K matmul's bindings with the RMSNorm fused in front: a holds
// the residual rows, g the norm's weight (rmsnorm.wgsl's five-binding
// layout: the weight where rmsnorm has its row list).

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w: array<u32>;
@group(0) @binding(3) var<storage, read> g: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

const NORM: bool = true;

// The norm weight's vec4 i.
fn gamma(i: u32) -> vec4<f32> {
    return g[i];
}

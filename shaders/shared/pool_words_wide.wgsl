// A quantized pool's u32 words through the serial kernel's vec4<u32> view
// of the pools (its wide loads).
fn kw(i: u32) -> u32 { return k_pool[i >> 2u][i & 3u]; }
fn vw(i: u32) -> u32 { return v_pool[i >> 2u][i & 3u]; }

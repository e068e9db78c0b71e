// A quantized pool's u32 words (its side words and scales), for the scale
// helpers: the pools bound as array<u32>.
fn kw(i: u32) -> u32 { return k_pool[i]; }
fn vw(i: u32) -> u32 { return v_pool[i]; }

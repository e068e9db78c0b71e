// generated from shaders/templates/serial_token.wgsl: the serial kernel's rows
//# The per-token code of attention_serial.wgsl, unrolled over the
//# invocation's rows and the head's vec4s, expanded by
//# src/gpu/kernels/template.rs (`cargo run --example shaders` writes it out
//# as compiled). Every private array is indexed by constants only, so a
//# compiler keeps it in registers (Mesa turns a dynamically indexed private
//# array into a ladder of selects), and the only loop an invocation runs per
//# token is the token loop itself.
//#
//# Template lines: `//#for NAME in LO..HI`, `//#if COND`, `//#elif COND`,
//# `//#else`, `//#end`; `{{EXPR}}` is integer arithmetic over the names
//# below (or `swz4(EXPR)` / `swz2(EXPR)`: a vec4's component(s)); lines
//# starting `//#` are comments of the template, not of the output.
//#   wgs    invocations per workgroup
//#   qs     query slots (1 for decode; a cascade segment pass holds more)
//#   ht     head rows per slot
//#   rows   qs x ht: the rows s0, s1, ... of one invocation
//#   d4     vec4s per head row
//#   wide   KV4s per vec4<u32> pool load (1, 2 or 4)
//#   quant  1 for int8/fp8 pools: each row also holds its values at the KV
//#          head's outlier channels (qf), and each token adds dot(qf, k_res)
//#   multi  1 with several slots: each row masks the tokens outside its own
//#          query's sliding window (the range walked is their union)
const WGS: u32 = {{wgs}}u;
//# The pools' element: `wide` KV4s per vec4<u32> load (fewer, wider loads:
//# on llvmpipe each lane-varying load is a loop over the lanes).
//#if wide > 1
alias SKV4 = vec4<u32>;
//#else
alias SKV4 = KV4;
//#end
//# Query rows of slot `s`; rows at or past `live` are zero.
fn ser_load_q(s: u32, qbase: u32, live: u32, kvh: u32) {
//#for slot in 0..qs
    if s == {{slot}}u {
//#for h in 0..ht
        if {{h}}u < live {
//#for d in 0..d4
            qv[{{(slot * ht + h) * d4 + d}}u] = q_conv(act_load(q[qbase + {{h * d4 + d}}u]) * q_smooth(kvh, {{d}}u));
//#end
//#if quant
            qf[{{slot * ht + h}}u] = q_res(qbase + {{h * d4}}u, kvh);
            has_res = has_res || any(qf[{{slot * ht + h}}u] != vec4<f32>(0.0));
//#end
        }
//#end
    }
//#end
}
//# One token: scores, online softmax with a lazy rescale, V.
fn ser_token(row: u32, kvh: u32, tok: u32) {
//# The token's K and V scales (1 unless the pool is quantized).
    let ks = k_scale(row, kvh);
    let vs = v_scale(row, kvh);
//#for r in 0..rows
    var s{{r}} = 0.0;
//#end
//#if wide > 1
//#for j in 0..d4 / wide
    let kw{{j}} = k_pool[row / {{wide}}u + {{j}}u];
//#end
//#end
//#for d in 0..d4
//#if wide == 4
    let k{{d}} = kw{{d / 4}}.{{swz4(d % 4)}};
//#elif wide == 2
    let k{{d}} = kw{{d / 2}}.{{swz2(d % 2)}};
//#else
    let k{{d}} = k_pool[row + {{d}}u];
//#end
//#for r in 0..rows
    s{{r}} += k_dot(qv[{{r * d4 + d}}u], k{{d}});
//#end
//#end
//#if quant
//# Only where the head has outlier channels: one branch per token, the same
//# way for the whole invocation.
    if has_res {
        let kr = k_res(row, kvh);
//#for r in 0..rows
        s{{r}} += dot(qf[{{r}}u], kr);
//#end
    }
//#end
//#if multi
//# Per slot: whether the token lies in its query's window.
//#for slot in 0..qs
    let in{{slot}} = params.sliding_window == 0u || qpos[{{slot}}u] - tok < params.sliding_window;
//#end
//#end
//# Branch-free: every row rescales by f (1 unless its max grew), so the code
//# is one basic block (a branch per row made the compile several times
//# slower on llvmpipe). The V scale goes into the weight.
//#for r in 0..rows
    let x{{r}} = logit(params, s{{r}} * ks, slope[{{r}}u], qpos[{{r / ht}}u], tok) * LOG2E;
//#if multi
//# Outside the window: no weight, and the max does not move.
    let mn{{r}} = select(m[{{r}}u], max(m[{{r}}u], x{{r}}), in{{r / ht}});
    let f{{r}} = exp2(m[{{r}}u] - mn{{r}});
    let w{{r}} = select(0.0, exp2(x{{r}} - mn{{r}}), in{{r / ht}});
//#else
    let mn{{r}} = max(m[{{r}}u], x{{r}});
    let f{{r}} = exp2(m[{{r}}u] - mn{{r}});
    let w{{r}} = exp2(x{{r}} - mn{{r}});
//#end
    l[{{r}}u] = l[{{r}}u] * f{{r}} + w{{r}};
    m[{{r}}u] = mn{{r}};
    let wv{{r}} = w{{r}} * vs;
//#end
//#if wide > 1
//#for j in 0..d4 / wide
    let vw{{j}} = v_pool[row / {{wide}}u + {{j}}u];
//#end
//#end
//#for d in 0..d4
//#if wide == 4
    let v{{d}} = kv_load(vw{{d / 4}}.{{swz4(d % 4)}});
//#elif wide == 2
    let v{{d}} = kv_load(vw{{d / 2}}.{{swz2(d % 2)}});
//#else
    let v{{d}} = kv_load(v_pool[row + {{d}}u]);
//#end
//#for r in 0..rows
    acc[{{r * d4 + d}}u] = acc[{{r * d4 + d}}u] * f{{r}} + wv{{r}} * v{{d}};
//#end
//#end
}
//# Output rows of slot `s` (`live` of them): `base` + h * `stride` vec4s;
//# split partials also write (max in natural-log units, sum) at
//# ml + h * ml_stride.
fn ser_out(s: u32, base: u32, stride: u32, live: u32, split: bool, ml: u32, ml_stride: u32) {
//#for slot in 0..qs
    if s == {{slot}}u {
//#for h in 0..ht
        if {{h}}u < live {
            let inv = select(1.0 / l[{{slot * ht + h}}u], 0.0, l[{{slot * ht + h}}u] == 0.0);
            let sc = select(inv, 1.0, split);
//#for d in 0..d4
            out[base + {{h}}u * stride + {{d}}u] = out_store(acc[{{(slot * ht + h) * d4 + d}}u] * sc);
//#end
            if split {
                out_ml[ml + {{h}}u * ml_stride] = vec2<f32>(m[{{slot * ht + h}}u] * LN2, l[{{slot * ht + h}}u]);
            }
        }
//#end
    }
//#end
}

// generated from shaders/templates/stream_step.wgsl: the stream kernel's step
//# The per-step code of attention_stream.wgsl, unrolled over the head rows,
//# the step's tokens and the lane's 16-byte chunks, expanded by
//# src/gpu/kernels/template.rs (`cargo run --example shaders` writes it out
//# as compiled). Every private array is indexed by constants only, and an
//# invocation runs no loop per step but the token loop itself.
//#
//# Names (see src/gpu/kernels/stream.rs):
//#   wg      invocations per workgroup
//#   lanes   lanes that share one token's row (a power of two, at most 16)
//#   ng      wg / lanes: lane groups, each walking its own tokens
//#   u       tokens per lane group per step (consecutive positions)
//#   chunks  16-byte chunks of a row per lane (lane c reads chunks c,
//#           c + lanes, ...: one warp instruction reads whole rows)
//#   wide    KV4s per 16-byte chunk (f32 1, f16/bf16 2, int8/fp8 4)
//#   lv      chunks x wide: vec4s of a query row (and of its accumulator)
//#           held per lane
//#   ht      head rows per workgroup (query heads of one KV head)
//#   quant   1 for int8/fp8 pools: each row also holds its values at the KV
//#           head's outlier channels (qf), lane 0 of a group adds them
//#   sub     1: a token's partial dots are summed by subgroup shuffles;
//#           0: through workgroup memory (`red`), two barriers per step
const WG: u32 = {{wg}}u;
const LANES: u32 = {{lanes}}u;
const NG: u32 = {{ng}}u;
const U: u32 = {{u}}u;
const NT: u32 = {{ng * u}}u;
const LV: u32 = {{lv}}u;
//#if wide > 1
alias SKV4 = vec4<u32>;
//#else
alias SKV4 = KV4;
//#end
//#if sub
const RED_LEN: u32 = 1u;
//#else
const RED_LEN: u32 = {{wg * ht * u}}u;
//#end

//# The lane's vec4s of each live query row, its ALiBi slope, and (quantized
//# pools) its values at the outlier channels; every row's max starts at
//# NEG_INF (sums and accumulators at 0, as private memory does).
fn st_init(qbase: u32, c: u32, live: u32, kvh: u32, h0: u32) {
//#for k in 0..chunks
//#for w in 0..wide
    let d{{k}}_{{w}} = (c + {{k * lanes}}u) * {{wide}}u + {{w}}u;
//#end
//#end
//#for h in 0..ht
    m[{{h}}u] = NEG_INF;
    if {{h}}u < live {
//#for k in 0..chunks
//#for w in 0..wide
        qv[{{h * lv + k * wide + w}}u] = q_conv(act_load(q[qbase + {{h}}u * HEAD_DIM4 + d{{k}}_{{w}}]) * q_smooth(kvh, d{{k}}_{{w}}));
//#end
//#end
//#if quant
        qf[{{h}}u] = q_res(qbase + {{h}}u * HEAD_DIM4, kvh);
//#end
        if params.alibi != 0u {
            slope[{{h}}u] = bitcast<f32>(table_at(params.slopes_off + h0 + {{h}}u));
        }
    }
//#end
}

//# The pool rows (KV4 index) of run indices i0 .. i0 + u - 1, INVALID past
//# the range or unreadable. One table lookup when the run's positions are
//# consecutive and in one block (the usual case), else one per token.
fn st_rows(p: AttnParams, span: Span, kvh: u32, range: Keys, i0: u32) -> vec4<u32> {
    var r = vec4<u32>(INVALID);
    if i0 >= range.end {
        return r;
    }
    let last = min(i0 + {{u - 1}}u, range.end - 1u);
    let t0 = key_at(range, i0);
    let tl = key_at(range, last);
    let r0 = token_row(p, span, kvh, t0);
    if r0 != INVALID && tl - t0 == last - i0 && t0 / BLOCK_SIZE == tl / BLOCK_SIZE {
//#for x in 0..u
        if i0 + {{x}}u <= last {
            r[{{x}}u] = r0 + {{x}}u * HEAD_DIM4;
        }
//#end
        return r;
    }
//#for x in 0..u
    if i0 + {{x}}u <= last {
        r[{{x}}u] = token_row(p, span, kvh, key_at(range, i0 + {{x}}u));
    }
//#end
    return r;
}

//# One step of a lane group: its u tokens from run index i0, whose rows
//# the previous step fetched (nrows). Loads first, then the next step's
//# rows, then the math: one max and one rescale per row per step.
fn st_step(p: AttnParams, span: Span, range: Keys, kvh: u32, c: u32, lid: u32, i0: u32, next: u32, q_pos: u32) {
    let cur = nrows;
//# An unreadable token reads row 0 (loads stay unconditional; its score
//# and weight are masked below).
//#for x in 0..u
    let ok{{x}} = cur[{{x}}u] != INVALID;
    let row{{x}} = select(0u, cur[{{x}}u], ok{{x}});
    let a{{x}} = row{{x}} / {{wide}}u + c;
//#end
//#for x in 0..u
//#for k in 0..chunks
    let k{{x}}_{{k}} = k_pool[a{{x}} + {{k * lanes}}u];
//#end
//#end
//#for x in 0..u
//#for k in 0..chunks
    let v{{x}}_{{k}} = v_pool[a{{x}} + {{k * lanes}}u];
//#end
//#end
    nrows = st_rows(p, span, kvh, range, next);
//#for h in 0..ht
//#for x in 0..u
    var s{{h}}_{{x}} = 0.0;
//#end
//#end
//#for x in 0..u
//#for k in 0..chunks
//#for w in 0..wide
//#if wide == 4
    let kk{{x}}_{{k}}_{{w}} = k{{x}}_{{k}}.{{swz4(w)}};
//#elif wide == 2
    let kk{{x}}_{{k}}_{{w}} = k{{x}}_{{k}}.{{swz2(w)}};
//#else
    let kk{{x}}_{{k}}_{{w}} = k{{x}}_{{k}};
//#end
//#for h in 0..ht
    s{{h}}_{{x}} += k_dot(qv[{{h * lv + k * wide + w}}u], kk{{x}}_{{k}}_{{w}});
//#end
//#end
//#end
//#end
//#if quant
//# The outlier channels' residuals, once per token (lane 0 of the group).
    if c == 0u {
//#for x in 0..u
        if ok{{x}} {
            let kr{{x}} = k_res(row{{x}}, kvh);
//#for h in 0..ht
            s{{h}}_{{x}} += dot(qf[{{h}}u], kr{{x}});
//#end
        }
//#end
    }
//#end
//# Sum the partial dots of the group's lanes: every lane gets the total.
//#if sub
//#if lanes > 1
//#for h in 0..ht
//#for x in 0..u
    s{{h}}_{{x}} += subgroupShuffleXor(s{{h}}_{{x}}, 1u);
//#end
//#end
//#end
//#if lanes > 2
//#for h in 0..ht
//#for x in 0..u
    s{{h}}_{{x}} += subgroupShuffleXor(s{{h}}_{{x}}, 2u);
//#end
//#end
//#end
//#if lanes > 4
//#for h in 0..ht
//#for x in 0..u
    s{{h}}_{{x}} += subgroupShuffleXor(s{{h}}_{{x}}, 4u);
//#end
//#end
//#end
//#if lanes > 8
//#for h in 0..ht
//#for x in 0..u
    s{{h}}_{{x}} += subgroupShuffleXor(s{{h}}_{{x}}, 8u);
//#end
//#end
//#end
//#else
//#for h in 0..ht
//#for x in 0..u
    red[lid * {{ht * u}}u + {{h * u + x}}u] = s{{h}}_{{x}};
//#end
//#end
    workgroupBarrier();
//#for h in 0..ht
//#for x in 0..u
    s{{h}}_{{x}} = 0.0;
//#end
//#end
//# A loop over the group's lanes (not unrolled: without subgroups this path
//# serves software adapters, where code size is compile time).
    for (var i = lid / LANES * LANES; i < (lid / LANES + 1u) * LANES; i++) {
//#for h in 0..ht
//#for x in 0..u
        s{{h}}_{{x}} += red[i * {{ht * u}}u + {{h * u + x}}u];
//#end
//#end
    }
    workgroupBarrier();
//#end
//#for x in 0..u
    let tok{{x}} = key_at(range, i0 + {{x}}u);
    let ks{{x}} = k_scale(row{{x}}, kvh);
    let vs{{x}} = v_scale(row{{x}}, kvh);
//#end
//#for h in 0..ht
//#for x in 0..u
    let x{{h}}_{{x}} = select(NEG_INF, logit(p, s{{h}}_{{x}} * ks{{x}}, slope[{{h}}u], q_pos, tok{{x}}) * LOG2E, ok{{x}});
//#end
    var mx{{h}} = m[{{h}}u];
//#for x in 0..u
    mx{{h}} = max(mx{{h}}, x{{h}}_{{x}});
//#end
    let f{{h}} = exp2(m[{{h}}u] - mx{{h}});
    var lt{{h}} = l[{{h}}u] * f{{h}};
//#for x in 0..u
    let w{{h}}_{{x}} = select(0.0, exp2(x{{h}}_{{x}} - mx{{h}}), ok{{x}});
    lt{{h}} += w{{h}}_{{x}};
//#end
    l[{{h}}u] = lt{{h}};
    m[{{h}}u] = mx{{h}};
//#end
//#for k in 0..chunks
//#for w in 0..wide
//#for x in 0..u
//#if wide == 4
    let vv{{x}}_{{k}}_{{w}} = select(vec4<f32>(0.0), kv_load(v{{x}}_{{k}}.{{swz4(w)}}) * vs{{x}}, ok{{x}});
//#elif wide == 2
    let vv{{x}}_{{k}}_{{w}} = select(vec4<f32>(0.0), kv_load(v{{x}}_{{k}}.{{swz2(w)}}) * vs{{x}}, ok{{x}});
//#else
    let vv{{x}}_{{k}}_{{w}} = select(vec4<f32>(0.0), kv_load(v{{x}}_{{k}}) * vs{{x}}, ok{{x}});
//#end
//#end
//#for h in 0..ht
    var a{{h}}_{{k}}_{{w}} = acc[{{h * lv + k * wide + w}}u] * f{{h}};
//#for x in 0..u
    a{{h}}_{{k}}_{{w}} += w{{h}}_{{x}} * vv{{x}}_{{k}}_{{w}};
//#end
    acc[{{h * lv + k * wide + w}}u] = a{{h}}_{{k}}_{{w}};
//#end
//#end
//#end
}

//# End of the pass: per row, every group's state into workgroup memory,
//# merged by st_combine (the file's); rows at or past `live` are not heads.
fn st_merge(p: AttnParams, seq: u32, h0: u32, part: u32, lid: u32, c: u32, g: u32, live: u32) {
//#for h in 0..ht
    workgroupBarrier();
//#for k in 0..chunks
//#for w in 0..wide
    mrg[g * HEAD_DIM4 + (c + {{k * lanes}}u) * {{wide}}u + {{w}}u] = acc[{{h * lv + k * wide + w}}u];
//#end
//#end
    if c == 0u {
        mrg_ml[g] = vec2<f32>(m[{{h}}u], l[{{h}}u]);
    }
    workgroupBarrier();
    if {{h}}u < live {
        st_combine(p, seq, h0 + {{h}}u, part, lid);
    }
//#end
}

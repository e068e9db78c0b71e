//! How the model goes onto the device: buffers, layouts and pipelines, the weights uploaded (the embedding and head in row chunks), the cache and its attention, every bind group; and the checks made before anything is.

use super::*;

impl LayerBinds {
    /// One layer's bind groups over the activations `[x, x normed, logit
    /// rows, qkv, attn out, ffn hidden]`.
    pub(super) fn new(
        dev: &wgpu::Device,
        [layout4, layout5]: [&BindGroupLayout; 2],
        u: &Uniforms,
        l: &LayerGpu,
        [x, xn, logit_idx, qkv, attn_out, h]: [&Buffer; 6],
    ) -> Self {
        // With post-norms the projections write xn (free by then), and a
        // norm adds it to the residual x; else they add to x themselves.
        let post = l.post_attn.is_some();
        let proj_out = if post { xn } else { x };
        let norm_add = |w: &Option<Buffer>| {
            w.as_ref()
                .map(|w| bind(dev, layout5, &[&u.norm_add, xn, w, logit_idx, x]))
        };
        LayerBinds {
            norm1: bind(dev, layout5, &[&u.norm, x, &l.attn_norm, logit_idx, xn]),
            qkv: bind(dev, layout4, &[&u.qkv, xn, &l.qkv.buf, qkv]),
            qk_norm: l
                .qk_norm
                .as_ref()
                .map(|w| bind(dev, layout4, &[&u.headnorm, w, logit_idx, qkv])),
            o: bind(dev, layout4, &[&u.o, attn_out, &l.o.buf, proj_out]),
            post_attn: norm_add(&l.post_attn),
            qkv_normed: bind(dev, layout5, &[&u.qkv, x, &l.qkv.buf, &l.attn_norm, qkv]),
            norm2: bind(dev, layout5, &[&u.norm, x, &l.ffn_norm, logit_idx, xn]),
            gate_up: bind(dev, layout4, &[&u.gate_up, xn, &l.gate_up.buf, h]),
            gate_up_normed: bind(
                dev,
                layout5,
                &[&u.gate_up, x, &l.gate_up.buf, &l.ffn_norm, h],
            ),
            down: bind(dev, layout4, &[&u.down, h, &l.down.buf, proj_out]),
            post_ffn: norm_add(&l.post_ffn),
        }
    }
}

impl Uniforms {
    pub(super) fn new(dev: &wgpu::Device) -> Self {
        Uniforms {
            norm: uniform(dev, "norm params"),
            norm_add: uniform(dev, "norm-add params"),
            headnorm: uniform(dev, "head norm params"),
            final_norm: uniform(dev, "final norm params"),
            rope: uniform(dev, "rope params"),
            qkv: uniform(dev, "qkv params"),
            o: uniform(dev, "o params"),
            gate_up: uniform(dev, "gate/up params"),
            down: uniform(dev, "down params"),
        }
    }
}

impl Model {
    /// Uploads the weights, makes the cache, the attention and every
    /// pipeline and bind group. Checks the shapes first: nothing is put on
    /// the device for a model this engine cannot run.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new(
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        w: &HostWeights,
        cfg: EngineConfig,
    ) -> Result<Self, ModelError> {
        pollster::block_on(Self::new_async(device, queue, w, cfg))
    }

    /// [`new`](Self::new) without blocking the thread: the path a browser
    /// takes (its error scopes resolve on the event loop).
    pub async fn new_async(
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        w: &HostWeights,
        cfg: EngineConfig,
    ) -> Result<Self, ModelError> {
        let s = w.shape;
        Self::check(w, &cfg)?;
        let gpu = Gpu::from_device(device, queue);
        // Refused before anything is made on the engine's device.
        let staging = cfg.matmul.resolve(&gpu)?;
        let decode_matmul = cfg.decode_matmul.resolve(&gpu);
        let dev = &gpu.device;
        let scope = dev.push_error_scope(wgpu::ErrorFilter::Validation);
        let oom = dev.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let (kv_layout, kv, layer_kv) = attention(&gpu, &s, &w.arch, &cfg)?;

        let qw = s.heads * s.head_dim;
        let [k_off, v_off, qkv_row] = fused_qkv(&s);

        let layout4 = layout(dev, 2);
        let layout5 = layout(dev, 3);
        let pl = |l: &BindGroupLayout| {
            dev.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some("model"),
                bind_group_layouts: &[Some(l)],
                immediate_size: 0,
            })
        };
        let (playout4, playout5) = (pl(&layout4), pl(&layout5));
        let embed_fmt = w.embed.fmt;
        let head = w.output.as_ref().unwrap_or(&w.embed);
        // Only the matmul reads a staging; the other kernels take any.
        let unused = MatmulStaging::Workgroup;
        let pipe_embed = pipeline(&gpu, &playout4, "embed", embed_fmt, 1, unused)?;
        let pipe_norm = pipeline(&gpu, &playout5, "rmsnorm", WeightFormat::F32, 1, unused)?;
        let pipe_rope = pipeline(&gpu, &playout4, "rope", WeightFormat::F32, 1, unused)?;
        let pipe_headnorm = pipeline(&gpu, &playout4, "headnorm", WeightFormat::F32, 1, unused)?;
        let [matmuls, splitks, splitks_norm] = matmul_pipelines(
            &gpu,
            [&playout4, &playout5],
            w,
            staging,
            decode_matmul == DecodeMatmul::SplitK,
        )?;
        let layers = upload_layers(&gpu, w)?;
        // Matrices of more rows than one binding holds (Gemma's 262,144-row
        // embedding, 189 MB in Q8_0) go up in row chunks.
        let upload_chunks = |label: &str, m: &HostMatrix| -> Vec<(u32, u32, Mat)> {
            let row_bytes = (m.cols / 32 * m.fmt.gpu_block_words() * 4) as u64;
            let most = (gpu.max_binding_bytes() / row_bytes.max(1)).max(1) as usize;
            // Chunks of a multiple of 64 rows, so the head's output offsets
            // stay 256-byte aligned.
            let per = if most >= m.rows {
                m.rows
            } else {
                (most / 64).max(1) * 64
            };
            (0..m.rows)
                .step_by(per)
                .map(|lo| {
                    let n = per.min(m.rows - lo);
                    (
                        lo as u32,
                        n as u32,
                        Mat::upload(&gpu, label, &m.row_range(lo, n)),
                    )
                })
                .collect()
        };
        let embed_chunks = upload_chunks("embedding", &w.embed);
        let head_chunks = w.output.as_ref().map(|m| upload_chunks("output", m));
        let out_norm = upload(&gpu, "output norm", &w.output_norm);
        // One table per RoPE base (Gemma 3: local and global layers).
        let bases = w.arch.rope_bases();
        let ropes: Vec<Buffer> = bases
            .iter()
            .map(|&b| upload(&gpu, "rope table", &rope_table(s.context, s.head_dim, b)))
            .collect();
        let layer_rope: Vec<usize> = w
            .arch
            .layers
            .iter()
            .map(|l| {
                bases
                    .iter()
                    .position(|&b| b == l.rope_base)
                    .expect("listed")
            })
            .collect();

        let (r, lr) = (cfg.max_rows, cfg.max_logit_rows);
        let ids = storage(dev, "ids", r * 4, U::empty());
        let pos = storage(dev, "positions", r * 4, U::empty());
        let logit_idx = storage(dev, "logit rows", lr * 4, U::empty());
        let x = storage(dev, "x", r * s.d_model * 4, U::empty());
        let xn = storage(dev, "x normed", r * s.d_model * 4, U::empty());
        let qkv = storage(dev, "qkv", r * qkv_row * 4, U::empty());
        let attn_out = storage(dev, "attn out", r * qw * 4, U::empty());
        let h = storage(dev, "ffn hidden", r * s.ffn * 4, U::empty());
        let xl = storage(dev, "x last", lr * s.d_model * 4, U::empty());
        let logits = storage(dev, "logits", lr * s.vocab * 4, U::COPY_SRC);
        let staging = dev.create_buffer(&wgpu::BufferDescriptor {
            label: Some("logits readback"),
            size: (lr * s.vocab * 4) as u64,
            usage: U::MAP_READ | U::COPY_DST,
            mapped_at_creation: false,
        });
        let u = Uniforms::new(dev);
        let acts = [&x, &xn, &logit_idx, &qkv, &attn_out, &h];
        let groups = layers
            .iter()
            .map(|l| LayerBinds::new(dev, [&layout4, &layout5], &u, l, acts))
            .collect();
        let g_embed = embed_chunks
            .iter()
            .map(|(_, _, m)| {
                let u = uniform(dev, "embed params");
                let g = bind(dev, &layout4, &[&u, &ids, &m.buf, &x]);
                (u, g)
            })
            .collect();
        let g_ropes = ropes
            .iter()
            .map(|t| bind(dev, &layout4, &[&u.rope, &pos, t, &qkv]))
            .collect();
        let g_final = bind(
            dev,
            &layout5,
            &[&u.final_norm, &x, &out_norm, &logit_idx, &xl],
        );
        let g_head = head_chunks
            .as_ref()
            .unwrap_or(&embed_chunks)
            .iter()
            .map(|(lo, n, m)| {
                let u = uniform(dev, "head params");
                // Columns lo.. of every logits row.
                let out = wgpu::BufferBinding {
                    buffer: &logits,
                    offset: *lo as u64 * 4,
                    size: None,
                };
                let g = dev.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some("head"),
                    layout: &layout4,
                    entries: &[
                        wgpu::BindGroupEntry {
                            binding: 0,
                            resource: u.as_entire_binding(),
                        },
                        wgpu::BindGroupEntry {
                            binding: 1,
                            resource: xl.as_entire_binding(),
                        },
                        wgpu::BindGroupEntry {
                            binding: 2,
                            resource: m.buf.as_entire_binding(),
                        },
                        wgpu::BindGroupEntry {
                            binding: 3,
                            resource: wgpu::BindingResource::Buffer(out),
                        },
                    ],
                });
                (*lo, *n, u, g)
            })
            .collect();
        let keep = [x, xn, h, xl, out_norm]
            .into_iter()
            .chain(ropes)
            .chain(head_chunks.into_iter().flatten().map(|(_, _, m)| m.buf))
            .collect();
        // Both popped (innermost first) before awaiting: no scope guard
        // lives across an await.
        let (oe, ve) = (oom.pop(), scope.pop());
        if let Some(e) = oe.await.or(ve.await) {
            return Err(ModelError::Gpu(e.into()));
        }
        Ok(Self {
            gpu,
            kv,
            kv_layout,
            layer_kv,
            arch: w.arch.clone(),
            shape: s,
            cfg,
            qkv_row,
            k_off,
            v_off,
            layout4,
            layout5,
            playout4,
            pipe_embed,
            pipe_norm,
            pipe_rope,
            pipe_headnorm,
            matmuls,
            splitks,
            splitks_norm,
            last_dispatches: 0,
            layers,
            groups,
            embed_chunks,
            head_fmt: head.fmt,
            g_embed,
            g_ropes,
            layer_rope,
            g_final,
            g_head,
            u,
            ids,
            pos,
            logit_idx,
            qkv,
            attn_out,
            logits,
            staging,
            skip_attention: false,
            _keep: keep,
        })
    }

    pub(super) fn check(w: &HostWeights, cfg: &EngineConfig) -> Result<(), ModelError> {
        let s = w.shape;
        let bad = |m: String| Err(ModelError::Shape(m));
        if s.layers != w.layers.len() || s.layers == 0 {
            return bad(format!(
                "{} layers in the shape, {} loaded",
                s.layers,
                w.layers.len()
            ));
        }
        if !s.d_model.is_multiple_of(32)
            || !s.ffn.is_multiple_of(32)
            || !s.head_dim.is_multiple_of(4)
            || s.head_dim == 0
        {
            return bad(format!(
                "d_model {} and ffn {} must be multiples of 32, head_dim {} of 4",
                s.d_model, s.ffn, s.head_dim
            ));
        }
        if s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) {
            return bad(format!("{} heads over {} KV heads", s.heads, s.kv_heads));
        }
        if s.context == 0 || s.context > 1 << 20 {
            return bad(format!("context {} outside 1..=2^20", s.context));
        }
        if cfg.max_rows == 0 || cfg.max_logit_rows == 0 || cfg.max_logit_rows > cfg.max_rows {
            return bad(format!(
                "max_rows {} and max_logit_rows {} must be positive, logit rows at most the rows",
                cfg.max_rows, cfg.max_logit_rows
            ));
        }
        let (d, qw, kw) = (s.d_model, s.heads * s.head_dim, s.kv_heads * s.head_dim);
        let want = |name: String, m: &HostMatrix, rows: usize, cols: usize| {
            m.check(&name)?;
            if m.rows != rows || m.cols != cols {
                return Err(ModelError::Shape(format!(
                    "{name}: {} x {}, expected {rows} x {cols}",
                    m.rows, m.cols
                )));
            }
            Ok(())
        };
        want("token_embd".into(), &w.embed, s.vocab, d)?;
        if let Some(o) = &w.output {
            want("output".into(), o, s.vocab, d)?;
        }
        if w.output_norm.len() != d {
            return bad(format!(
                "output_norm has {} values, expected {d}",
                w.output_norm.len()
            ));
        }
        for (i, l) in w.layers.iter().enumerate() {
            want(format!("blk.{i}.attn_q"), &l.q, qw, d)?;
            want(format!("blk.{i}.attn_k"), &l.k, kw, d)?;
            want(format!("blk.{i}.attn_v"), &l.v, kw, d)?;
            want(format!("blk.{i}.attn_output"), &l.o, d, qw)?;
            want(format!("blk.{i}.ffn_gate"), &l.gate, s.ffn, d)?;
            want(format!("blk.{i}.ffn_up"), &l.up, s.ffn, d)?;
            want(format!("blk.{i}.ffn_down"), &l.down, d, s.ffn)?;
            if l.attn_norm.len() != d || l.ffn_norm.len() != d {
                return bad(format!("blk.{i}: norms must have {d} values"));
            }
            let hd = s.head_dim;
            let a = &w.arch;
            for (what, v, want, len) in [
                ("attn_q_norm", &l.q_norm, a.qk_norm, hd),
                ("attn_k_norm", &l.k_norm, a.qk_norm, hd),
                ("post_attention_norm", &l.post_attn_norm, a.post_norms, d),
                ("post_ffw_norm", &l.post_ffn_norm, a.post_norms, d),
            ] {
                match v {
                    Some(v) if want && v.len() == len => {}
                    None if !want => {}
                    _ => {
                        return bad(format!(
                            "blk.{i}.{what}: {} ({len} values where the architecture has it)",
                            if want {
                                "missing or of the wrong length"
                            } else {
                                "not used by this architecture"
                            }
                        ))
                    }
                }
            }
        }
        if w.arch.layers.len() != s.layers {
            return bad(format!(
                "{} layers described by the architecture, {} in the shape",
                w.arch.layers.len(),
                s.layers
            ));
        }
        Ok(())
    }
}

pub(super) fn storage(dev: &wgpu::Device, label: &str, bytes: usize, extra: U) -> Buffer {
    dev.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size: bytes.max(16) as u64,
        usage: U::STORAGE | U::COPY_DST | extra,
        mapped_at_creation: false,
    })
}

pub(super) fn upload<T: bytemuck::Pod>(gpu: &Gpu, label: &str, data: &[T]) -> Buffer {
    let bytes: &[u8] = bytemuck::cast_slice(data);
    let b = storage(&gpu.device, label, bytes.len(), U::empty());
    gpu.queue.write_buffer(&b, 0, bytes);
    b
}

pub(super) fn uniform(dev: &wgpu::Device, label: &str) -> Buffer {
    dev.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size: 32,
        usage: U::UNIFORM | U::COPY_DST,
        mapped_at_creation: false,
    })
}

pub(super) fn layout(dev: &wgpu::Device, n_read: u32) -> BindGroupLayout {
    let entry = |binding, ty| wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty,
        count: None,
    };
    let st = |read_only| wgpu::BindingType::Buffer {
        ty: wgpu::BufferBindingType::Storage { read_only },
        has_dynamic_offset: false,
        min_binding_size: None,
    };
    let mut entries = vec![entry(
        0,
        wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Uniform,
            has_dynamic_offset: false,
            min_binding_size: None,
        },
    )];
    for i in 0..n_read {
        entries.push(entry(1 + i, st(true)));
    }
    entries.push(entry(1 + n_read, st(false)));
    dev.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: Some("model layout"),
        entries: &entries,
    })
}

pub(super) fn bind(dev: &wgpu::Device, layout: &BindGroupLayout, bufs: &[&Buffer]) -> BindGroup {
    let entries: Vec<_> = (0u32..)
        .zip(bufs)
        .map(|(i, b)| wgpu::BindGroupEntry {
            binding: i,
            resource: b.as_entire_binding(),
        })
        .collect();
    dev.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout,
        entries: &entries,
    })
}

/// The WGSL source of a kernel as compiled: the prelude of constants, the
/// shared quant helpers, the kernel file, and for the matmul the staging
/// file `staging` picks (`Auto` reads as `Workgroup` here: resolve it
/// against a device first).
pub fn shader_source(
    kernel: &str,
    fmt: WeightFormat,
    rt: u32,
    staging: MatmulStaging,
) -> Result<String, ModelError> {
    const BLOCK: &str = include_str!("../../shaders/block.wgsl");
    let (body, tail) = match kernel {
        "matmul" => (
            include_str!("../../shaders/matmul.wgsl"),
            match staging {
                MatmulStaging::Subgroup => {
                    concat!(
                        include_str!("../../shaders/matmul_subgroup.wgsl"),
                        "\n",
                        include_str!("../../shaders/matmul_out.wgsl"),
                        "\n",
                        include_str!("../../shaders/block.wgsl")
                    )
                }
                _ => concat!(
                    include_str!("../../shaders/matmul_tile.wgsl"),
                    "\n",
                    include_str!("../../shaders/matmul_out.wgsl"),
                    "\n",
                    include_str!("../../shaders/block.wgsl")
                ),
            },
        ),
        "matmul_splitk" | "matmul_splitk_norm" => (
            include_str!("../../shaders/matmul_splitk.wgsl"),
            match (staging, kernel == "matmul_splitk_norm") {
                (MatmulStaging::Subgroup, false) => concat!(
                    include_str!("../../shaders/matmul_splitk_io.wgsl"),
                    include_str!("../../shaders/matmul_splitk_sg.wgsl"),
                    include_str!("../../shaders/matmul_out.wgsl"),
                    include_str!("../../shaders/block.wgsl")
                ),
                (MatmulStaging::Subgroup, true) => concat!(
                    include_str!("../../shaders/matmul_splitk_norm_io.wgsl"),
                    include_str!("../../shaders/matmul_splitk_sg.wgsl"),
                    include_str!("../../shaders/matmul_out.wgsl"),
                    include_str!("../../shaders/block.wgsl")
                ),
                (_, false) => concat!(
                    include_str!("../../shaders/matmul_splitk_io.wgsl"),
                    include_str!("../../shaders/matmul_splitk_wg.wgsl"),
                    include_str!("../../shaders/matmul_out.wgsl"),
                    include_str!("../../shaders/block.wgsl")
                ),
                (_, true) => concat!(
                    include_str!("../../shaders/matmul_splitk_norm_io.wgsl"),
                    include_str!("../../shaders/matmul_splitk_wg.wgsl"),
                    include_str!("../../shaders/matmul_out.wgsl"),
                    include_str!("../../shaders/block.wgsl")
                ),
            },
        ),
        "embed" => (include_str!("../../shaders/embed.wgsl"), BLOCK),
        "rmsnorm" => (include_str!("../../shaders/rmsnorm.wgsl"), ""),
        "rope" => (include_str!("../../shaders/rope.wgsl"), ""),
        "headnorm" => (include_str!("../../shaders/headnorm.wgsl"), ""),
        other => return Err(ModelError::Shape(format!("no kernel named {other}"))),
    };
    Ok(format!(
        "// prelude (generated)\nconst FMT: u32 = {}u;\nconst BLOCK_WORDS: u32 = {}u;\nconst R: u32 = {rt}u;\n\n{}\n{body}\n{tail}",
        fmt.shader_id(),
        fmt.gpu_block_words(),
        include_str!("../../shaders/quant.wgsl"),
    ))
}

/// The kernels' names, for a tool that prints every shader.
pub const KERNELS: [&str; 7] = [
    "matmul",
    "matmul_splitk",
    "matmul_splitk_norm",
    "embed",
    "rmsnorm",
    "rope",
    "headnorm",
];

pub(super) fn pipeline(
    gpu: &Gpu,
    layout: &PipelineLayout,
    kernel: &str,
    fmt: WeightFormat,
    rt: u32,
    staging: MatmulStaging,
) -> Result<ComputePipeline, ModelError> {
    let src = shader_source(kernel, fmt, rt, staging)?;
    let module = gpu
        .device
        .create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(kernel),
            source: wgpu::ShaderSource::Wgsl(src.into()),
        });
    Ok(gpu
        .device
        .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(kernel),
            layout: Some(layout),
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        }))
}

/// A readback or poll failure, as the library reports its own.
#[cfg(not(target_arch = "wasm32"))]
pub(super) fn device_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Gpu(pagedattn::gpu::GpuError::Device(e.to_string()))
}

pub(super) fn words(v: &[u32; 8]) -> &[u8] {
    bytemuck::cast_slice(v)
}

pub(super) fn f(x: f32) -> u32 {
    x.to_bits()
}

/// The cos/sin table of RoPE, as llama.cpp computes it: theta_i = pos *
/// base^(-2i/d) with the power taken in f32 step by step, then cos and sin.
pub fn rope_table(max_pos: usize, head_dim: usize, base: f32) -> Vec<[f32; 2]> {
    let half = head_dim / 2;
    let scale = base.powf(-2.0 / head_dim as f32);
    let mut t = Vec::with_capacity(max_pos * half);
    for p in 0..max_pos {
        let mut theta = p as f32;
        for _ in 0..half {
            let th = theta as f64;
            t.push([th.cos() as f32, th.sin() as f32]);
            theta *= scale;
        }
    }
    t
}

/// The fused QKV row: Q, then K and V each on a 256-byte boundary.
/// Returns K's offset, V's offset and the row's length, in floats.
pub(super) fn fused_qkv(s: &Shape) -> [usize; 3] {
    let (qw, kw) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let align = |x: usize| x.div_ceil(64) * 64;
    let k_off = align(qw);
    let v_off = align(k_off + kw);
    [k_off, v_off, (v_off + kw).div_ceil(4) * 4]
}

/// The matmul pipelines of every weight format the model holds, at each
/// row tile: the tiled matmul's, and with `splitk` the split-K matmul's.
pub(super) type Matmuls = HashMap<(WeightFormat, u32), ComputePipeline>;

pub(super) fn matmul_pipelines(
    gpu: &Gpu,
    [layout4, layout5]: [&PipelineLayout; 2],
    w: &HostWeights,
    staging: MatmulStaging,
    splitk: bool,
) -> Result<[Matmuls; 3], ModelError> {
    let head = w.output.as_ref().unwrap_or(&w.embed);
    let mut fmts = vec![head.fmt];
    // The norm-fused split-K matmul runs QKV and gate/up (stacked, each
    // of its parts' one format).
    let mut normed = Vec::new();
    for l in &w.layers {
        fmts.extend([l.q.fmt, l.o.fmt, l.gate.fmt, l.down.fmt]);
        normed.extend([l.q.fmt, l.gate.fmt]);
    }
    fmts.sort_by_key(|f| f.shader_id());
    fmts.dedup();
    let [mut tiled, mut split, mut split_norm] = [HashMap::new(), HashMap::new(), HashMap::new()];
    for &fm in &fmts {
        for rt in MATMUL_TILES {
            tiled.insert((fm, rt), pipeline(gpu, layout4, "matmul", fm, rt, staging)?);
        }
        if splitk {
            for rt in SPLITK_TILES {
                let p = pipeline(gpu, layout4, "matmul_splitk", fm, rt, staging)?;
                split.insert((fm, rt), p);
                if normed.contains(&fm) {
                    let p = pipeline(gpu, layout5, "matmul_splitk_norm", fm, rt, staging)?;
                    split_norm.insert((fm, rt), p);
                }
            }
        }
    }
    Ok([tiled, split, split_norm])
}

/// Every layer's weights on the device: Q, K and V stacked into one matrix
/// at the fused row's offsets ([`fused_qkv`]), gate and up into another.
pub(super) fn upload_layers(gpu: &Gpu, w: &HostWeights) -> Result<Vec<LayerGpu>, ModelError> {
    let s = w.shape;
    let [k_off, v_off, qkv_row] = fused_qkv(&s);
    let (qw, kw) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let mut layers = Vec::with_capacity(s.layers);
    for (i, l) in w.layers.iter().enumerate() {
        let qkv = HostMatrix::stack(
            &format!("blk.{i} qkv"),
            &[
                (&l.q, k_off - qw),
                (&l.k, v_off - k_off - kw),
                (&l.v, qkv_row - v_off - kw),
            ],
        )?;
        let gate_up = HostMatrix::stack(&format!("blk.{i} gate/up"), &[(&l.gate, 0), (&l.up, 0)])?;
        layers.push(LayerGpu {
            attn_norm: upload(gpu, "attn norm", &l.attn_norm),
            qkv: Mat::upload(gpu, "qkv", &qkv),
            o: Mat::upload(gpu, "attn output", &l.o),
            ffn_norm: upload(gpu, "ffn norm", &l.ffn_norm),
            gate_up: Mat::upload(gpu, "gate/up", &gate_up),
            down: Mat::upload(gpu, "down", &l.down),
            qk_norm: match (&l.q_norm, &l.k_norm) {
                (Some(q), Some(k)) => Some(upload(gpu, "qk norm", &[q.as_slice(), k].concat())),
                _ => None,
            },
            post_attn: l
                .post_attn_norm
                .as_ref()
                .map(|w| upload(gpu, "post-attention norm", w)),
            post_ffn: l
                .post_ffn_norm
                .as_ref()
                .map(|w| upload(gpu, "post-FFN norm", w)),
        });
    }
    Ok(layers)
}

/// The model's KV cache (one layer a transformer layer), its attention
/// with its pipelines compiled, and their plans, which read K, V and Q
/// from the fused QKV rows ([`fused_qkv`]).
/// The layer groups' pools and attention: with `cfg.layer_groups`, one
/// pool per group of layers that attend alike (a window group's pool of
/// `cfg.window_blocks`), else one pool for every layer. Also each layer's
/// (group, layer in the group's pool, variant in the group's).
#[allow(clippy::type_complexity)]
pub(super) fn attention(
    gpu: &Gpu,
    s: &Shape,
    arch: &ArchSpec,
    cfg: &EngineConfig,
) -> Result<(LayerGroups, Vec<KvGroup>, Vec<(usize, u32, usize)>), ModelError> {
    let layout = if cfg.layer_groups {
        arch.layer_groups()
    } else {
        LayerGroups::uniform(s.layers as u32, GroupKind::Full)
            .map_err(|e| ModelError::Shape(e.to_string()))?
    };
    let qkv_row = fused_qkv(s)[2] as u32;
    let mut kv = Vec::with_capacity(layout.groups().len());
    let mut layer_kv = vec![(0, 0, 0); s.layers];
    for (g, group) in layout.groups().iter().enumerate() {
        let mut windows: Vec<Option<u32>> = Vec::new();
        for &l in &group.layers {
            let w = arch.layers[l as usize].window;
            if !windows.contains(&w) {
                windows.push(w);
            }
        }
        for (i, &l) in group.layers.iter().enumerate() {
            let w = arch.layers[l as usize].window;
            let v = windows.iter().position(|&x| x == w).expect("listed");
            layer_kv[l as usize] = (g, i as u32, v);
        }
        let variants = windows
            .iter()
            .map(|&window| AttnOptions {
                sliding_window: window,
                scale: arch.attn_scale,
                ..Default::default()
            })
            .collect();
        let blocks = match group.kind {
            GroupKind::Full => cfg.num_blocks,
            _ => cfg.window_blocks.unwrap_or(cfg.num_blocks),
        };
        let cache = KvCache::new(
            gpu,
            KvCacheConfig::new(blocks, cfg.block_size, s.kv_heads as u32, s.head_dim as u32)
                .with_layers(group.layers.len() as u32)
                .with_dtype(cfg.kv_dtype)
                .with_layer_group(g as u16),
        )?;
        let attn = match cfg.kernel {
            Some(k) => PagedAttention::new(
                gpu,
                &cache,
                s.heads as u32,
                &pagedattn::gpu::AttentionConfig::new().kernel(k),
            )?,
            None => PagedAttention::new(gpu, &cache, s.heads as u32, &Default::default())?,
        };
        attn.warm_up(gpu, &[ActDtype::F32])?;
        let (mut wplan, mut aplan) = (cache.plan(), attn.plan());
        wplan.set_kv_stride(Some(qkv_row));
        aplan.set_q_stride(Some(qkv_row));
        kv.push(KvGroup {
            cache,
            attn,
            wplan,
            aplan,
            variants,
        });
    }
    Ok((layout, kv, layer_kv))
}

/// Bind groups of one layer: norm 1, QKV, the head norms, output, its
/// post-norm, norm 2, gate/up, down, its post-norm; and QKV and gate/up
/// with their norms fused in, for the split-K matmul.
pub(super) struct LayerBinds {
    pub(super) norm1: BindGroup,
    pub(super) qkv: BindGroup,
    /// QKV with norm 1 fused in (the split-K matmul's NORM variant).
    pub(super) qkv_normed: BindGroup,
    pub(super) qk_norm: Option<BindGroup>,
    pub(super) o: BindGroup,
    pub(super) post_attn: Option<BindGroup>,
    pub(super) norm2: BindGroup,
    pub(super) gate_up: BindGroup,
    /// Gate/up with norm 2 fused in.
    pub(super) gate_up_normed: BindGroup,
    pub(super) down: BindGroup,
    pub(super) post_ffn: Option<BindGroup>,
}

pub(super) struct Mat {
    pub(super) buf: Buffer,
    pub(super) fmt: WeightFormat,
}

/// The uniforms written each step.
pub(super) struct Uniforms {
    pub(super) norm: Buffer,
    pub(super) norm_add: Buffer,
    pub(super) headnorm: Buffer,
    pub(super) final_norm: Buffer,
    pub(super) rope: Buffer,
    pub(super) qkv: Buffer,
    pub(super) o: Buffer,
    pub(super) gate_up: Buffer,
    pub(super) down: Buffer,
}

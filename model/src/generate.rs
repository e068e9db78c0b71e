//! `pagedattn generate`: text in, text out, on the default adapter, with a
//! report of speed and of what paging saved.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use pagedattn::blocks::Preemption;
use pagedattn::gpu::KvDtype;

use crate::defaults::{GenerationDefaults, GenerationOverrides};
use crate::engine::{EngineConfig, Model};
use crate::load::{Loaded, ModelSource};
use crate::sample::{LogitBias, Penalties};
use crate::serve::{Completion, Decoding, Request, ServeStats, Server, ServerConfig};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use crate::ModelError;

/// What to generate, and on what.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// One prompt, or many (`--prompts FILE`), served together.
    pub prompts: Vec<String>,
    /// Wrap each prompt in the chat template (the Instruct model's).
    pub chat: bool,
    /// The chat template's system prompt (`None`: the model's default).
    pub system: Option<String>,
    /// Parallel samples per prompt (1: one sequence).
    pub samples: usize,
    /// Beam width (0: no beam search).
    pub beams: usize,
    /// The sampling values and `max_tokens` given; each one left out takes
    /// the model's default ([`GenerationDefaults`]).
    pub sampling: GenerationOverrides,
    pub seed: u64,
    /// `(token, bias)` pairs (see [`LogitBias`]).
    pub logit_bias: Vec<(u32, f32)>,
    pub model: PathBuf,
    /// A synthetic model instead of the file `model`.
    pub synthetic: Option<crate::synthetic::Synthetic>,
    pub kv_dtype: KvDtype,
    pub num_blocks: u32,
    pub max_batch_tokens: usize,
    pub max_seqs: usize,
    /// Stream the first sequence of the first prompt as it is generated.
    pub stream: bool,
    /// The backends the device may be opened on.
    pub backends: wgpu::Backends,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            prompts: vec!["Tell me a story".into()],
            chat: true,
            system: None,
            samples: 1,
            beams: 0,
            sampling: GenerationOverrides::default(),
            seed: 0,
            logit_bias: Vec::new(),
            model: crate::config::default_model_path(),
            synthetic: None,
            backends: wgpu::Backends::all(),
            kv_dtype: KvDtype::F16,
            num_blocks: 512,
            max_batch_tokens: 256,
            max_seqs: 32,
            stream: true,
        }
    }
}

/// The engine's device on the default adapter of the backends `allowed`
/// (the caller's choice: the CLI reads `PAGEDATTN_BACKEND`).
pub fn open_device(
    allowed: wgpu::Backends,
) -> Result<(wgpu::Device, wgpu::Queue, String), ModelError> {
    // The library's order: the platform's own API first, GL last.
    let mut last = String::new();
    let mut found = None;
    for backends in pagedattn::gpu::adapter_backends(allowed) {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = backends;
        let instance = wgpu::Instance::new(desc);
        match pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            ..Default::default()
        })) {
            Ok(a) => {
                found = Some(a);
                break;
            }
            Err(e) => last = e.to_string(),
        }
    }
    let adapter = found.ok_or_else(|| {
        ModelError::Device(format!(
            "no GPU adapter ({last}); on Linux without a GPU, install mesa-vulkan-drivers (lavapipe)"
        ))
    })?;
    let info = adapter.get_info();
    let name = format!("{} ({:?})", info.name, info.backend);
    // Subgroups where the adapter has them: the matmul's subgroup staging
    // (and the library's subgroup kernels) can then be chosen.
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("pagedattn-model"),
        required_features: adapter.features() & wgpu::Features::SUBGROUP,
        required_limits: adapter.limits(),
        ..Default::default()
    }))
    .map_err(|e| ModelError::Device(format!("could not open a device on {name}: {e}")))?;
    Ok((device, queue, name))
}

/// Everything a run reports.
#[derive(Clone, Debug)]
pub struct Report {
    pub adapter: String,
    pub completions: Vec<Completion>,
    pub texts: Vec<Vec<String>>,
    pub prompt_tokens: Vec<usize>,
    pub stats: ServeStats,
    pub block_size: u32,
    pub load_secs: f64,
    pub seconds: f64,
    /// The pools' layer groups (one per window; full attention one).
    pub groups: pagedattn::blocks::LayerGroups,
}

/// Checks the options that need no file or device.
pub fn check(o: &GenerateOptions) -> Result<(), ModelError> {
    let bad = |m: String| Err(ModelError::Request(m));
    if o.prompts.is_empty() || o.prompts.iter().any(|p| p.is_empty()) {
        return bad("an empty prompt".into());
    }
    if o.samples == 0 || o.samples > o.max_seqs {
        return bad(format!(
            "--samples {} outside 1..={}",
            o.samples, o.max_seqs
        ));
    }
    if o.beams > o.max_seqs {
        return bad(format!("--beams {} outside 0..={}", o.beams, o.max_seqs));
    }
    if o.beams > 0 && o.samples > 1 {
        return bad("--beams and --samples together: choose one".into());
    }
    o.sampling.check()?;
    let g = &o.sampling;
    let sampled = g.temperature.is_some()
        || g.top_p.is_some()
        || g.top_k.is_some()
        || g.min_p.is_some()
        || g.repetition_penalty.is_some()
        || !o.logit_bias.is_empty();
    if o.beams > 0 && sampled {
        return bad("--beams is deterministic: it takes no --temperature, --top-p, --top-k, --min-p, --repetition-penalty or --logit-bias".into());
    }
    LogitBias::new(o.logit_bias.clone(), usize::MAX)?;
    if o.num_blocks == 0 || o.num_blocks > 1 << 20 {
        return bad(format!("--num-blocks {} outside 1..=1048576", o.num_blocks));
    }
    Ok(())
}

/// The options' prompts as requests: the chat template applied where
/// asked, sampled (the flags given, the model's defaults `d` for the
/// rest) or beam-searched, ending at the end-of-turn token.
fn requests(
    o: &GenerateOptions,
    d: &GenerationDefaults,
    tokenizer: &Tokenizer,
    vocab: usize,
) -> Result<Vec<Request>, ModelError> {
    let g = &o.sampling;
    let params = d.params(g.temperature, g.top_p, g.top_k, g.min_p, o.seed);
    params.validate(vocab)?;
    let (penalties, logit_bias) = if o.beams > 0 {
        (Penalties::default(), LogitBias::default())
    } else {
        let penalties = Penalties {
            repetition: d.repetition(g.repetition_penalty, g.temperature),
            ..Penalties::default()
        };
        (penalties, LogitBias::new(o.logit_bias.clone(), vocab)?)
    };
    let max_tokens = g.max_tokens.unwrap_or(d.max_tokens);
    let mut requests = Vec::new();
    for p in &o.prompts {
        let text = if o.chat {
            tokenizer.chat_prompt(p, o.system.as_deref())
        } else {
            p.clone()
        };
        let ids = tokenizer.try_encode(&text, o.chat)?;
        let decoding = if o.beams > 0 {
            Decoding::Beam { width: o.beams }
        } else {
            Decoding::Sample {
                params,
                n: o.samples,
            }
        };
        requests.push(Request {
            decoding,
            stop: vec![tokenizer.eos_id()],
            penalties,
            logit_bias: logit_bias.clone(),
            ..Request::greedy(ids, max_tokens)
        });
    }
    Ok(requests)
}

/// What the requests decode with, as one line.
fn describe_sampling(o: &GenerateOptions, r: &Request) -> String {
    match r.decoding {
        Decoding::Beam { width } => {
            format!(
                "beam search of width {width}, up to {} tokens",
                r.max_tokens
            )
        }
        Decoding::Sample { params: p, n } => {
            let off = |x: String, is_off: bool| if is_off { "off".to_string() } else { x };
            let given = if o.sampling.is_empty() {
                "the model's defaults"
            } else {
                "the flags given, the model's defaults for the rest"
            };
            format!(
                "sampling ({given}): temperature {}, top_p {}, top_k {}, min_p {}, repetition_penalty {}, {} logit biases, seed {}, up to {} tokens, {n} sample(s)",
                p.temperature,
                p.top_p,
                off(p.top_k.to_string(), p.top_k == 0),
                off(p.min_p.to_string(), p.min_p == 0.0),
                off(r.penalties.repetition.to_string(), r.penalties.repetition == 1.0),
                r.logit_bias.entries().len(),
                p.seed,
                r.max_tokens
            )
        }
    }
}

/// Loads the model, serves the prompts, streams the first to `out` and
/// writes the report.
pub fn run(o: &GenerateOptions, out: &mut dyn Write) -> Result<Report, ModelError> {
    check(o)?;
    let t0 = Instant::now();
    let Loaded {
        weights, tokenizer, ..
    } = ModelSource::new(o.model.clone(), o.synthetic).load()?;
    let defaults = GenerationDefaults::for_arch(weights.arch.arch);
    let requests = requests(o, &defaults, &tokenizer, weights.shape.vocab)?;
    let sampling = describe_sampling(o, &requests[0]);
    let (device, queue, adapter) = open_device(o.backends)?;
    let ecfg = EngineConfig {
        num_blocks: o.num_blocks,
        block_size: 16,
        kv_dtype: o.kv_dtype,
        max_rows: o.max_batch_tokens,
        max_logit_rows: o.max_seqs,
        ..EngineConfig::default()
    };
    let model = Model::new(&device, &queue, &weights, ecfg)?;
    drop(weights);
    let groups = model.kv_layout().clone();
    let load_secs = t0.elapsed().as_secs_f64();
    let scfg = ServerConfig {
        max_seqs: o.max_seqs,
        max_batch_tokens: o.max_batch_tokens,
        preemption: Preemption::Auto,
        swap_blocks: o.num_blocks,
        prefix_caching: true,
        num_blocks: None,
        ..ServerConfig::default()
    };
    let mut server = Server::new(model, scfg)?;
    server.profile = Some(1);
    let mut ids = Vec::new();
    let mut prompt_tokens = Vec::new();
    for r in requests {
        prompt_tokens.push(r.prompt.len());
        ids.push(server.add(r)?);
    }
    let say = |out: &mut dyn Write, s: &str| {
        let _ = out.write_all(s.as_bytes());
        let _ = out.flush();
    };
    say(
        out,
        &format!(
            "{adapter}: {} prompt(s), {} tokens of prompt; model loaded in {load_secs:.1} s\n{sampling}\n",
            ids.len(),
            prompt_tokens.iter().sum::<usize>()
        ),
    );
    let first = ids[0];
    let streaming = o.stream && o.beams == 0;
    let mut dec = StreamDecoder::new();
    let mut completions = Vec::new();
    let many = ids.len() > 1;
    let mut last_note = Instant::now();
    while server.has_work() {
        let mut on_token = |r, g: &crate::serve::Generated| {
            let t = g.tokens[g.tokens.len() - 1];
            if streaming && r == first && g.branch == 0 && t != tokenizer.eos_id() {
                let s = dec.push(&tokenizer, t);
                let _ = out.write_all(s.as_bytes());
                let _ = out.flush();
            }
        };
        let done = server.step(&mut on_token)?;
        if many && (last_note.elapsed().as_secs_f64() > 2.0 || !done.is_empty()) {
            let (w, r, s) = server.sched.queue_lengths();
            let st = server.sched.blocks().stats();
            say(
                out,
                &format!(
                    "\n[step {}: {w} waiting, {r} running, {s} swapped; {} blocks used, {} shared; {} finished]",
                    server.stats.steps,
                    st.used,
                    st.shared,
                    completions.len() + done.len()
                ),
            );
            last_note = Instant::now();
        }
        completions.extend(done);
    }
    if streaming {
        say(out, "\n");
    }
    let texts: Vec<Vec<String>> = ids
        .iter()
        .map(|id| {
            completions
                .iter()
                .find(|c| c.request == *id)
                .map(|c| {
                    c.sequences
                        .iter()
                        .map(|g| tokenizer.decode_reply(&g.tokens))
                        .collect()
                })
                .unwrap_or_default()
        })
        .collect();
    let report = Report {
        adapter,
        completions,
        texts,
        prompt_tokens,
        stats: server.stats,
        block_size: 16,
        load_secs,
        seconds: t0.elapsed().as_secs_f64(),
        groups,
    };
    say(out, &render(o, &report));
    Ok(report)
}

/// The report after the text.
pub fn render(o: &GenerateOptions, r: &Report) -> String {
    let mut s = String::new();
    let shown_first = o.stream && o.beams == 0;
    for (i, texts) in r.texts.iter().enumerate() {
        for (j, t) in texts.iter().enumerate() {
            if shown_first && i == 0 && j == 0 {
                continue;
            }
            let what = if o.beams > 0 {
                format!("beam {j}")
            } else {
                format!("sample {j}")
            };
            s += &format!("--- prompt {i}, {what}:\n{}\n", t.trim_end());
        }
    }
    let st = &r.stats;
    let rate = |n: usize, t: f64| if t > 0.0 { n as f64 / t } else { 0.0 };
    s += &format!(
        "\nprefill: {} tokens, {:.1} tokens/s | decode: {} tokens, {:.1} tokens/s (peak batch {})\n",
        st.prefill_tokens,
        rate(st.prefill_tokens, st.prefill_secs),
        st.decode_tokens,
        rate(st.decode_tokens, st.decode_secs),
        st.peak_batch
    );
    match st.attention_share {
        Some(a) => {
            s += &format!(
                "attention kernels: {:.1} % of a decode step ({} rows)\n",
                a * 100.0,
                st.profiled_rows
            )
        }
        None => s += "attention share: not measured (no decode step)\n",
    }
    let saved = st.contiguous_blocks.saturating_sub(st.peak_blocks_used);
    s += &format!(
        "KV blocks ({} tokens each): peak {} used, {} shared; contiguous reservation (prompt + max tokens per sequence) would hold {} ({:.1} % saved); {} copy-on-write copies, {} preemptions\n",
        r.block_size,
        st.peak_blocks_used,
        st.peak_blocks_shared,
        st.contiguous_blocks,
        if st.contiguous_blocks > 0 { 100.0 * saved as f64 / st.contiguous_blocks as f64 } else { 0.0 },
        st.copies,
        st.preempted,
    );
    if r.groups.groups().len() > 1 {
        // What the pools of the layer groups held at their peak, against
        // one pool of every layer (the full group's blocks in every layer).
        let describe = |blocks: &[usize]| -> String {
            r.groups
                .groups()
                .iter()
                .zip(blocks)
                .map(|(g, b)| {
                    let kind = match g.kind {
                        pagedattn::blocks::GroupKind::Full => "full".to_string(),
                        pagedattn::blocks::GroupKind::Window(w) => format!("window {w}"),
                        pagedattn::blocks::GroupKind::SinksAndWindow { sinks, window } => {
                            format!("{sinks} sinks + window {window}")
                        }
                    };
                    format!("{kind} on {} layers: {b} blocks", g.layers.len())
                })
                .collect::<Vec<_>>()
                .join("; ")
        };
        let pct = |k: usize, f: usize| {
            if f > 0 {
                100.0 * k as f64 / f as f64
            } else {
                0.0
            }
        };
        let (kept, full) = (st.last_layer_blocks, st.last_full_retention_layer_blocks);
        s += &format!(
            "KV blocks by layer group at the last step ({}): {kept} layer-blocks held, against {full} under full retention ({:.1} %)\n",
            describe(&st.last_group_blocks),
            pct(kept, full)
        );
        let (kept, full) = (st.peak_layer_blocks, st.full_retention_layer_blocks);
        s += &format!(
            "  at the peak ({}; a prefill takes its prompt's blocks in every group): {kept} against {full} ({:.1} %)\n",
            describe(&st.peak_group_blocks),
            pct(kept, full)
        );
    }
    s += &format!("{:.1} s in all ({:.1} s loading)\n", r.seconds, r.load_secs);
    s
}

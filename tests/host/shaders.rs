//! Every WGSL kernel, specialised for a spread of shapes, is validated by
//! naga and translated to SPIR-V (Vulkan), MSL (Metal), HLSL (DX12) and GLSL
//! (GL), so a change that breaks a backend fails here without its hardware.
//! Each param struct's host size must equal naga's layout of the WGSL struct.

use naga::back::{glsl, hlsl, msl, spv};
use naga::valid::{Capabilities, ModuleInfo, ValidationFlags, Validator};
use pagedattn::gpu::shader::{source, Family, Shader, ShaderShape};

/// The kernels of one family, from the registry.
fn family(f: Family) -> Vec<Shader> {
    Shader::ALL
        .into_iter()
        .filter(|k| k.entry().family == f)
        .collect()
}
use pagedattn::gpu::{params::PARAM_STRUCTS, KvDtype};
use std::sync::atomic::{AtomicUsize, Ordering};

fn shapes() -> Vec<ShaderShape> {
    let mut v = Vec::new();
    for (head_dim, group) in [
        (64, 1),
        (80, 4),
        (96, 8),
        (128, 4),
        (128, 8),
        (256, 1),
        (256, 8),
    ] {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Int8, KvDtype::Fp8E4M3] {
            for block_size in [1, 16, 256] {
                for (qtile, paged) in [(1, true), (4, true), (1, false)] {
                    // Activations: f32, f16 (bf16 at block 16) in and
                    // out, 16-bit in with f32 split-K partials out.
                    for (i, (q_f16, out_f16)) in [(false, false), (true, true), (true, false)]
                        .into_iter()
                        .enumerate()
                    {
                        // Head tiles, lanes per token and subgroups vary with
                        // the shape (read only by the kernels that use them).
                        let htile = [0, 1, 3][(i + block_size as usize) % 3];
                        let lpt = pagedattn::gpu::shader::lanes_per_token(head_dim, [8, 4, 1][i]);
                        let subgroups = i != 1 && lpt > 1;
                        v.push(ShaderShape {
                            htile,
                            lpt,
                            subgroups,
                            head_dim,
                            group,
                            block_size,
                            dtype,
                            qtile,
                            paged,
                            q_f16,
                            out_f16,
                            // bf16 activations and outputs at one block size.
                            act_bf16: (q_f16 || out_f16) && block_size == 16,
                            // The stream kernel's step (see stream_fit).
                            unroll: [4, 2, 1][(i + qtile as usize) % 3],
                            workgroup: [128, 64, 256][i],
                            trusted: false,
                        });
                    }
                }
            }
        }
    }
    v
}

/// `shape` as the stream kernel takes it: lanes per row dividing the row's
/// 16-byte chunks; `None` where rows are not whole chunks (the kernel is not
/// offered there).
fn stream_fit(shape: ShaderShape) -> Option<ShaderShape> {
    let w = pagedattn::gpu::shader::stream_wide(shape.dtype);
    let d4 = shape.head_dim / 4;
    if !d4.is_multiple_of(w) {
        return None;
    }
    let mut lpt = shape.lpt.max(1);
    while !(d4 / w).is_multiple_of(lpt) {
        lpt /= 2;
    }
    Some(ShaderShape {
        lpt,
        subgroups: shape.subgroups && lpt > 1,
        ..shape
    })
}

fn parse(kernel: Shader, shape: &ShaderShape) -> (naga::Module, ModuleInfo) {
    let src = source(kernel, shape).unwrap();
    parse_src(
        &format!("{} {shape:?}", kernel.name()),
        &src,
        shape.subgroups,
    )
}

fn parse_src(what: &str, src: &str, subgroups: bool) -> (naga::Module, ModuleInfo) {
    let module = naga::front::wgsl::parse_str(src)
        .unwrap_or_else(|e| panic!("{what}: {}", e.emit_to_string(src)));
    // unpack2x16float / pack2x16float: core WGSL, which naga files under this
    // capability; wgpu grants it on every backend with downlevel SHADER_F16_IN_F32.
    let mut caps = Capabilities::SHADER_FLOAT16_IN_FLOAT32;
    if subgroups {
        caps |= Capabilities::SUBGROUP;
    }
    let info = Validator::new(ValidationFlags::all(), caps)
        .subgroup_stages(naga::valid::ShaderStages::COMPUTE)
        .subgroup_operations(naga::valid::SubgroupOperationSet::all())
        .validate(&module)
        .unwrap_or_else(|e| panic!("{what}: {}", e.emit_to_string(src)));
    (module, info)
}

fn translate(kernel: Shader, shape: &ShaderShape, module: &naga::Module, info: &ModuleInfo) {
    // 64 invocations, but a serial cascade pass (several query slots) runs
    // 8, and the rows kernel rows x lanes per row x token groups.
    let wgs = match kernel.name() {
        "attention_serial" => pagedattn::gpu::shader::serial_workgroup_size(shape.qtile),
        "attention_rows" => pagedattn::gpu::shader::rows_workgroup_size(shape),
        "attention_stream" => shape.workgroup,
        _ => 64,
    };
    // wgpu's GL backend has no subgroups, so those shapes never reach it.
    let gl = !(shape.subgroups
        && matches!(
            kernel.name(),
            "attention_lanes" | "attention_rows" | "attention_stream"
        ));
    translate_src(&format!("{kernel} {shape:?}"), module, info, wgs, gl);
}

/// Writes `module` as SPIR-V, MSL, HLSL and (where `gl`) GLSL, checking
/// each has a compute entry of `wgs` invocations.
fn translate_src(what: &str, module: &naga::Module, info: &ModuleInfo, wgs: u32, gl: bool) {
    // Vulkan.
    let spv_opts = spv::Options {
        flags: spv::WriterFlags::empty(),
        ..Default::default()
    };
    let words = spv::write_vec(module, info, &spv_opts, None)
        .unwrap_or_else(|e| panic!("SPIR-V {what}: {e}"));
    assert!(
        words.len() > 5 && words[0] == 0x0723_0203,
        "SPIR-V {what}: bad magic"
    );
    // Metal (the MSL version wgpu targets on current macOS).
    let msl_opts = msl::Options {
        lang_version: (2, 4),
        ..Default::default()
    };
    let msl_pipe = msl::PipelineOptions {
        entry_point: Some((naga::ShaderStage::Compute, "main".into())),
        ..Default::default()
    };
    let (msl_src, _) = msl::write_string(module, info, &msl_opts, &msl_pipe)
        .unwrap_or_else(|e| panic!("MSL {what}: {e}"));
    assert!(
        msl_src.contains("kernel void"),
        "MSL {what}: no kernel entry"
    );
    // DX12 (shader model 6.0 as wgpu's DX12 backend).
    let hlsl_opts = hlsl::Options {
        shader_model: hlsl::ShaderModel::V6_0,
        ..Default::default()
    };
    let mut hlsl_src = String::new();
    hlsl::Writer::new(&mut hlsl_src, &hlsl_opts, &Default::default())
        .write(module, info, None)
        .unwrap_or_else(|e| panic!("HLSL {what}: {e}"));
    assert!(
        hlsl_src.contains(&format!("[numthreads({wgs}, 1, 1)]")),
        "HLSL {what}: no compute entry of {wgs} invocations"
    );
    // GL: GLSL ES 3.10, the compute-capable version wgpu's GL backend uses.
    if !gl {
        return;
    }
    let glsl_opts = glsl::Options {
        version: glsl::Version::Embedded {
            version: 310,
            is_webgl: false,
        },
        ..Default::default()
    };
    let glsl_pipe = glsl::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: "main".into(),
        multiview: None,
    };
    let mut glsl_src = String::new();
    glsl::Writer::new(
        &mut glsl_src,
        module,
        info,
        &glsl_opts,
        &glsl_pipe,
        naga::proc::BoundsCheckPolicies::default(),
    )
    .and_then(|mut w| w.write())
    .unwrap_or_else(|e| panic!("GLSL {what}: {e}"));
    assert!(
        glsl_src.contains(&format!("local_size_x = {wgs}")),
        "GLSL {what}: no compute layout of {wgs} invocations"
    );
}

#[test]
fn every_mla_kernel_validates_and_translates_to_every_backend() {
    use pagedattn::gpu::{mla_source, ActDtype, KvDtype, MlaCacheConfig, MlaShape};
    let mut n = 0;
    // DeepSeek's 512 + 64 at 128 and 1 heads, a small row at 12 heads, and
    // the widest row: every dtype the pools take.
    for (rank, rope, heads) in [(512, 64, 128), (512, 64, 1), (64, 16, 12), (1000, 24, 16)] {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
            let cfg = MlaCacheConfig {
                kv_lora_rank: rank,
                rope_dim: rope,
                dtype,
                ..MlaCacheConfig::deepseek(1, 1)
            };
            let base = MlaShape::new(&cfg, heads);
            assert!(
                base.workgroup_bytes() <= 16384,
                "{base:?}: {} bytes",
                base.workgroup_bytes()
            );
            // Every activation and output codec, and the split decode's
            // 16-bit reads with f32 partials.
            for kernel in family(Family::Mla) {
                for (act, out) in [
                    (ActDtype::F32, ActDtype::F32),
                    (ActDtype::F16, ActDtype::F16),
                    (ActDtype::Bf16, ActDtype::Bf16),
                    (ActDtype::F16, ActDtype::F32),
                ] {
                    let shape = base.with_io(act, out);
                    let src = mla_source(kernel, &shape).unwrap();
                    let what = format!("{kernel} {shape:?}");
                    let (module, info) = parse_src(&what, &src, false);
                    let wgs = if kernel == Shader::MlaDecode {
                        shape.workgroup_size()
                    } else {
                        64
                    };
                    translate_src(&what, &module, &info, wgs, true);
                    n += 1;
                }
            }
        }
    }
    eprintln!("{n} MLA kernel instances validated and translated");
    assert_eq!(n, 4 * 3 * 4 * family(Family::Mla).len());
}

#[test]
fn every_kernel_validates_and_translates_to_every_backend() {
    let mut work = Vec::new();
    let mut skipped = 0;
    let kernels = family(Family::Attention);
    for &kernel in &kernels {
        for shape in shapes() {
            if !kernel.takes(shape.dtype) {
                skipped += 1;
                continue;
            }
            let shape = match kernel {
                Shader::AttentionStream => match stream_fit(shape) {
                    Some(s) => s,
                    None => {
                        skipped += 1;
                        continue;
                    }
                },
                _ => shape,
            };
            work.push((kernel, shape));
        }
    }
    // Each instance is independent CPU work (naga parses, validates and
    // writes four languages): the machine's threads share the list. A
    // panic in one (naming its kernel and shape) fails the test at the
    // join, so past it every instance passed.
    let next = AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((kernel, shape)) = work.get(i) else {
                    break;
                };
                let (module, info) = parse(*kernel, shape);
                translate(*kernel, shape, &module, &info);
            });
        }
    });
    let n = work.len();
    eprintln!("{n} kernel instances validated and translated to SPIR-V, MSL, HLSL and GLSL ({threads} threads)");
    assert_eq!(n + skipped, kernels.len() * shapes().len());
    assert!(n > skipped);
}

#[test]
fn param_struct_sizes_match_wgsl() {
    let shape = ShaderShape {
        group: 4,
        ..ShaderShape::default()
    };
    let (module, _) = parse(Shader::Attention, &shape);
    let mut layouter = naga::proc::Layouter::default();
    layouter.update(module.to_ctx()).unwrap();
    for (name, host_size) in PARAM_STRUCTS {
        let (handle, _) = module
            .types
            .iter()
            .find(|(_, t)| t.name.as_deref() == Some(*name))
            .unwrap_or_else(|| panic!("struct {name} not in common.wgsl"));
        let wgsl_size = layouter[handle].size as usize;
        assert_eq!(
            wgsl_size, *host_size,
            "{name}: WGSL {wgsl_size} bytes, host {host_size}"
        );
    }
}

#[test]
fn a_broken_shader_is_rejected() {
    // The checks above must be able to fail: a kernel body with a type error.
    let shape = ShaderShape {
        head_dim: 64,
        ..ShaderShape::default()
    };
    let src = source(Shader::CopyBlocks, &shape)
        .unwrap()
        .replace("let e = i % per;", "let e: f32 = i % per;");
    let parsed = naga::front::wgsl::parse_str(&src);
    let invalid = match parsed {
        Err(_) => true,
        Ok(m) => Validator::new(ValidationFlags::all(), Capabilities::empty())
            .validate(&m)
            .is_err(),
    };
    assert!(invalid);
}

/// Every `.wgsl` file, by its path under `shaders/`, as the repository
/// holds it (import lines included).
fn wgsl_files() -> Vec<(String, String)> {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    // The library's kernels and parts, and the bench's own kernel.
    for (root, prefix) in [
        (repo.join("shaders"), ""),
        (repo.join("cli/shaders"), "cli:"),
    ] {
        let mut dirs = vec![root.clone()];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    dirs.push(p);
                } else if p.extension().is_some_and(|x| x == "wgsl") {
                    let rel = p.strip_prefix(&root).unwrap().display().to_string();
                    out.push((
                        format!("{prefix}{rel}"),
                        std::fs::read_to_string(&p).unwrap(),
                    ));
                }
            }
        }
    }
    out.sort();
    out
}

/// The shared files an import composes (any one of them, by the shape).
fn files_of(import: &str) -> Vec<String> {
    let shared = |names: &[&str]| -> Vec<String> {
        names.iter().map(|n| format!("shared/{n}.wgsl")).collect()
    };
    match import {
        "saturate" => shared(&["saturate"]),
        "kv" => shared(&["kv_f32", "kv_f16", "kv_bf16", "kv_int8", "kv_fp8"]),
        "qdot" => shared(&["qdot"]),
        "act" => shared(&["act_f32", "act_f16", "act_bf16"]),
        "out" => shared(&["out_f32", "out_f16", "out_bf16"]),
        "table_walk" => shared(&["table_walk"]),
        "pool_words" => shared(&["pool_words", "pool_words_wide"]),
        "scales" => shared(&["scales_plain", "scales_int8", "scales_fp8", "q_res"]),
        "common" => vec!["common.wgsl".into()],
        "mla_common" => vec!["mla/common.wgsl".into()],
        _ => vec![],
    }
}

fn uses_word(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(i, _)| {
        let ok = |c: Option<char>| !c.is_some_and(|c| c.is_alphanumeric() || c == '_');
        ok(text[..i].chars().next_back()) && ok(text[i + word.len()..].chars().next())
    })
}

/// A newcomer opening any `.wgsl` file sees where each name comes from:
/// its top lists the imports it uses, each line saying what that import
/// defines. Checked here: every import is known and described as the
/// registry describes it; a file that uses a name an import defines
/// imports it (code only, comments aside); a kernel imports whatever its
/// parts import, before them; and the composed kernels keep no import line.
#[test]
fn every_wgsl_file_names_its_imports() {
    use pagedattn::gpu::shader::{imports, IMPORTS};
    let files = wgsl_files();
    assert!(files.len() >= 30, "{} files", files.len());
    let by_path: std::collections::HashMap<&str, &str> = files
        .iter()
        .map(|(p, s)| (p.as_str(), s.as_str()))
        .collect();
    let mut checked_uses = 0;
    for (path, text) in &files {
        if path.starts_with("templates/") {
            continue; // expanded by the serial and stream kernels' modules
        }
        let names = imports(text);
        for line in text.lines().take_while(|l| l.starts_with("//#import ")) {
            let rest = line["//#import ".len()..].trim_start();
            let (name, said) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
            let (_, defines) = IMPORTS
                .iter()
                .find(|(n, _)| *n == name)
                .unwrap_or_else(|| panic!("{path}: unknown import `{name}`"));
            if name != "generated" {
                assert!(
                    said.trim_start().starts_with(defines),
                    "{path}: `{name}` is said to give `{}`, the registry says `{defines}`",
                    said.trim()
                );
            }
        }
        // Code only: a name in a comment is not a use.
        let code: String = text
            .lines()
            .map(|l| l.split("//").next().unwrap_or(""))
            .collect::<Vec<_>>()
            .join("\n");
        for (name, defines) in IMPORTS {
            let idents: Vec<&str> = defines
                .split_whitespace()
                .filter(|w| w.chars().all(|c| c.is_alphanumeric() || c == '_'))
                .filter(|w| w.chars().any(|c| c.is_ascii_uppercase() || c == '_'))
                .collect();
            // A file defining the name itself is its source, not a user.
            let own = |w: &str| {
                ["const ", "fn ", "alias ", "struct "]
                    .iter()
                    .any(|k| code.contains(&format!("{k}{w}")))
            };
            let mla = path.starts_with("mla/");
            // The two preludes share BLOCK_SIZE and INVALID; each file
            // imports its own family's.
            let family_ok = match *name {
                "constants" | "common" => !mla,
                "mla_constants" | "mla_common" => mla,
                _ => true,
            };
            for w in idents {
                if family_ok && uses_word(&code, w) && !own(w) && !names.contains(name) {
                    panic!("{path} uses `{w}` but does not import `{name}`");
                }
                checked_uses += 1;
            }
        }
        // A kernel composes its parts: what they import comes first.
        for (i, name) in names
            .iter()
            .enumerate()
            .filter(|_| !path.starts_with("shared/"))
        {
            for f in files_of(name) {
                let part = by_path
                    .get(f.as_str())
                    .unwrap_or_else(|| panic!("{path}: `{name}` composes {f}, which is missing"));
                for need in imports(part) {
                    assert!(
                        names[..i].contains(&need),
                        "{path} imports `{name}` ({f}), which needs `{need}` before it"
                    );
                }
            }
        }
    }
    // Every kernel file is registered once, and every registered file exists.
    for kernel in Shader::ALL {
        let e = kernel.entry();
        assert_eq!(e.shader, kernel, "{kernel}: registry out of order");
        let file = match e.family {
            Family::Attention => format!("{}.wgsl", e.name),
            Family::Mla => format!("mla/{}.wgsl", e.name.trim_start_matches("mla_")),
        };
        assert_eq!(
            by_path.get(file.as_str()),
            Some(&e.text),
            "{kernel}: {file}"
        );
    }
    let kernel_files = files
        .iter()
        .filter(|(p, _)| {
            !["shared/", "templates/", "cli:"]
                .iter()
                .any(|d| p.starts_with(d))
                && !p.ends_with("common.wgsl")
        })
        .count();
    assert_eq!(
        kernel_files,
        Shader::ALL.len(),
        "a kernel file outside the registry"
    );
    // The composed kernels: no import line is left, and each starts with
    // its first import's text.
    for kernel in family(Family::Attention) {
        let shape = shapes()
            .into_iter()
            .find(|s| kernel.takes(s.dtype))
            .unwrap();
        let src = source(kernel, &shape).unwrap();
        assert!(!src.contains("//#import"), "{kernel} keeps an import line");
        assert!(
            src.starts_with("// generated by src/gpu/compose.rs"),
            "{kernel}"
        );
    }
    eprintln!(
        "{} files, {checked_uses} (file, name) uses checked",
        files.len()
    );
}

//! Writes every kernel's WGSL exactly as pagedattn compiles it, for a grid
//! of shapes, so a reader can see what runs: the generated prelude, the
//! shared code from `shaders/shared/` and the kernel's own file, composed.
//!
//! `cargo run --example shaders -- [DIR]` (default `target/shaders`): one
//! file per (kernel, shape), named after both, and `index.txt` listing them.
//! No adapter is needed; the sources are the ones `PagedAttention` and
//! `KvCache` hand to wgpu for these shapes (subgroup variants included).

use pagedattn::gpu::shader::{source, Family, Shader, ShaderShape};
use pagedattn::gpu::{mla_source, KvDtype, MlaCacheConfig, MlaShape};
use std::fmt::Write as _;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::path::PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "target/shaders".into()),
    );
    std::fs::create_dir_all(&dir)?;
    let mut index = String::new();
    let mut written = 0;
    for kernel in Shader::ALL
        .into_iter()
        .filter(|k| k.entry().family == Family::Attention)
    {
        for shape in shapes(kernel.name()) {
            if !kernel.takes(shape.dtype) {
                continue;
            }
            let Some(src) = source(kernel, &shape) else {
                continue;
            };
            let name = format!(
                "{}-{}-d{}-g{}-ht{}-b{}-q{}-lpt{}{}{}{}{}.wgsl",
                kernel.name(),
                shape.dtype.name(),
                shape.head_dim,
                shape.group,
                shape.head_tile(),
                shape.block_size,
                shape.qtile,
                shape.lpt,
                if shape.subgroups { "-subgroups" } else { "" },
                if shape.q_f16 { "-qf16" } else { "" },
                if shape.out_f16 { "-outf16" } else { "" },
                if shape.paged { "" } else { "-contiguous" },
            );
            std::fs::write(dir.join(&name), &src)?;
            let _ = writeln!(index, "{name}  {} lines", src.lines().count());
            written += 1;
        }
    }
    // The MLA kernels at DeepSeek's latent row (512 + 64, 128 heads), per
    // pool dtype.
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
        let cfg = MlaCacheConfig {
            dtype,
            ..MlaCacheConfig::deepseek(1, 1)
        };
        let shape = MlaShape::new(&cfg, 128);
        for kernel in Shader::ALL
            .into_iter()
            .filter(|k| k.entry().family == Family::Mla)
        {
            let Some(src) = mla_source(kernel, &shape) else {
                continue;
            };
            let name = format!(
                "{}-{}-r{}-v{}-hg{}-b{}.wgsl",
                kernel.name(),
                dtype.name(),
                shape.row4 * 4,
                shape.v4 * 4,
                shape.hg,
                shape.block_size
            );
            std::fs::write(dir.join(&name), &src)?;
            let _ = writeln!(index, "{name}  {} lines", src.lines().count());
            written += 1;
        }
    }
    std::fs::write(dir.join("index.txt"), &index)?;
    println!("{written} shaders written to {}", dir.display());
    Ok(())
}

/// The shapes written per kernel: every KV dtype at a Llama-like head
/// (head_dim 128, a GQA group of 4), decode and prefill tiles, and the
/// variants each kernel has (lanes per token and subgroups for `lanes` and
/// the rows pass, f16 activations, the contiguous baseline).
fn shapes(kernel: &str) -> Vec<ShaderShape> {
    let mut out = Vec::new();
    for dtype in KvDtype::ALL {
        let base = ShaderShape {
            group: 4,
            dtype,
            ..Default::default()
        };
        out.push(base);
        match kernel {
            "attention" => {
                out.push(ShaderShape { qtile: 4, ..base });
                out.push(ShaderShape {
                    q_f16: true,
                    out_f16: true,
                    ..base
                });
                out.push(ShaderShape {
                    paged: false,
                    ..base
                });
            }
            "attention_lanes" => {
                out.push(ShaderShape { lpt: 8, ..base });
                out.push(ShaderShape {
                    lpt: 8,
                    subgroups: true,
                    ..base
                });
            }
            "attention_serial" => {
                out.push(ShaderShape { qtile: 2, ..base });
                out.push(ShaderShape {
                    head_dim: 64,
                    group: 8,
                    ..base
                });
            }
            "attention_rows" => {
                out.push(ShaderShape {
                    qtile: 4,
                    lpt: 4,
                    ..base
                });
                out.push(ShaderShape {
                    qtile: 4,
                    lpt: 4,
                    subgroups: true,
                    ..base
                });
            }
            "write_kv" | "write_kv_q" => {
                out.push(ShaderShape {
                    q_f16: true,
                    ..base
                });
            }
            _ => {}
        }
    }
    out
}

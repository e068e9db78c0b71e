//! What an attention variant and a `PagedAttention` are built with: `Split`, `AttnOptions`, `AttentionConfig`, `ShaderChecks`.

use super::*;

/// How decode splits long sequences into partitions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Split {
    /// Decide per batch, kernel and adapter
    /// ([`PagedAttention::partition_tokens`]): split when the batch alone
    /// would leave the device idle, and where the adapter ends long loops
    /// early (llvmpipe), keep each pass under its cap.
    #[default]
    Auto,
    /// One workgroup per (sequence, kv head).
    Never,
    /// Partitions of this many tokens (a positive multiple of 64).
    Tokens(u32),
}

/// The attention variant and its options.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct AttnOptions {
    /// q·k multiplier; `1 / sqrt(head_dim)` when `None`.
    pub scale: Option<f32>,
    /// Logit soft-cap `cap * tanh(s / cap)`.
    pub soft_cap: Option<f32>,
    /// Attend to the last `w` positions only.
    pub sliding_window: Option<u32>,
    /// ALiBi slope per query head.
    pub alibi_slopes: Option<Vec<f32>>,
    /// Attention sink logit per query head (gpt-oss): `exp(sink)` joins
    /// the softmax denominator and adds no value. In the units of the
    /// scaled scores; applied once per query row, where the partials are
    /// merged (a plan with sinks always writes partials), so split-K, the
    /// cascade and prefill all take it.
    pub sinks: Option<Vec<f32>>,
    /// StreamingLLM: the first `k` positions stay visible beside the
    /// sliding window (which it needs). The blocks between may be released
    /// ([`crate::blocks::BlockManager::release_outside_sinks_and_window`]):
    /// their table entries stay, as [`crate::blocks::RELEASED`], so
    /// positions stay right. Decode and prefill on every kernel; `Auto`
    /// takes no cascade with it.
    pub sink_tokens: Option<u32>,
    /// Split-K policy.
    pub split: Split,
    /// Shared prefixes read once (cascade decode; plan/run API, decode
    /// only). A plan uses the cascade for all its variants, or for none:
    /// none if any variant says `Off`; else when some variant says `On` and
    /// the batch shares a segment, or under `Auto` when the cost model pays.
    pub cascade: Cascade,
}

impl AttnOptions {
    /// Checks the options for `num_heads` query heads; the message says
    /// what is wrong. Shared by every backend's host path.
    pub fn validate(&self, num_heads: u32) -> Result<(), OptionError> {
        if let Split::Tokens(t) = self.split {
            if t == 0 || !t.is_multiple_of(64) {
                return Err(OptionError::Partition(t));
            }
        }
        if let Some(s) = &self.alibi_slopes {
            if s.len() != num_heads as usize {
                return Err(OptionError::SlopeCount {
                    slopes: s.len() as u64,
                    heads: num_heads,
                });
            }
            if let Some((h, &x)) = s.iter().enumerate().find(|(_, x)| !x.is_finite()) {
                return Err(OptionError::Slope {
                    head: h as u32,
                    value: x,
                });
            }
        }
        if let Some(s) = &self.sinks {
            if s.len() != num_heads as usize {
                return Err(OptionError::SinkCount {
                    sinks: s.len() as u64,
                    heads: num_heads,
                });
            }
            if let Some((h, &x)) = s.iter().enumerate().find(|(_, x)| !x.is_finite()) {
                return Err(OptionError::Sink {
                    head: h as u32,
                    value: x,
                });
            }
        }
        if let Some(x) = self.scale.filter(|x| !x.is_finite()) {
            return Err(OptionError::Scale(x));
        }
        if let Some(c) = self.soft_cap.filter(|c| !c.is_finite() || *c <= 0.0) {
            return Err(OptionError::SoftCap(c));
        }
        if self.sliding_window == Some(0) {
            return Err(OptionError::ZeroWindow);
        }
        if let Some(k) = self.sink_tokens {
            if k == 0 || self.sliding_window.is_none() {
                return Err(OptionError::SinkTokens(k));
            }
            if self.cascade == Cascade::On {
                return Err(OptionError::CascadeWithSinkTokens);
            }
        }
        Ok(())
    }
}

/// How a [`PagedAttention`] is built: passed at construction, never read
/// from the environment (the CLI maps `PAGEDATTN_KERNEL` onto it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AttentionConfig {
    /// The decode kernel; `None`: the adapter's default (see [`Kernel`]).
    pub kernel: Option<Kernel>,
    /// Longest shared segment one cascade pass walks where the segment pass
    /// runs on GPUs (the rows kernel), in tokens: a multiple of 16 from 16
    /// to 4096; [`CASCADE_CHUNK_TOKENS`](CASCADE_CHUNK_TOKENS) by
    /// default (shorter segments helped small batches on an H200 and hurt
    /// large ones: `benches/NOTES.md` item 33).
    pub cascade_chunk_tokens: u32,
    /// Whether the attention kernels are built with wgpu's shader runtime
    /// checks ([`ShaderChecks`]).
    pub shader_checks: ShaderChecks,
    /// The `stream` kernel's tokens per lane group per step (1, 2 or 4);
    /// 0: its default, shrunk to fit the device.
    pub stream_unroll: u32,
    /// The `stream` kernel's invocations per workgroup (64, 128 or 256);
    /// 0: its default, shrunk to fit the device.
    pub stream_workgroup: u32,
    /// `false`: no per-token table lookup, each sequence's blocks assumed
    /// consecutive from its first table entry: a contiguous-KV baseline of
    /// the same design, for the bench's paged / contiguous ratio.
    #[doc(hidden)]
    pub paged: bool,
}

/// Whether attention kernels are built with wgpu's shader runtime checks:
/// index clamping, loop bounding (a 64-bit counter and an extra exit test
/// in every loop) and integer division checks. Trusted modules skip them
/// (`create_shader_module_trusted`). That is sound here because every
/// table and argument is validated on the host before any dispatch, and
/// the kernels keep their own `INVALID` tests for table entries past the
/// pool; wgpu's Vulkan backend keeps the driver's robust buffer access
/// either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ShaderChecks {
    /// Trusted on native hardware adapters; checked on software adapters
    /// (llvmpipe, SwiftShader, WARP: there the checks cost little, `serial`
    /// 1.05x, and one unexplained crash in a cold run is not ruled out:
    /// `benches/NOTES.md` item 64) and in the browser (where wgpu has no
    /// trusted modules).
    #[default]
    Auto,
    /// wgpu's checks in every kernel.
    Checked,
    /// No runtime checks (native only; the browser stays checked).
    Trusted,
}

impl ShaderChecks {
    /// Whether kernels are built trusted under this choice on `gpu`.
    pub fn trusted_on(self, gpu: &Gpu) -> bool {
        !cfg!(target_arch = "wasm32")
            && match self {
                ShaderChecks::Trusted => true,
                ShaderChecks::Checked => false,
                ShaderChecks::Auto => !gpu.is_software(),
            }
    }
}

impl Default for AttentionConfig {
    fn default() -> Self {
        Self {
            kernel: None,
            cascade_chunk_tokens: CASCADE_CHUNK_TOKENS,
            shader_checks: ShaderChecks::Auto,
            stream_unroll: 0,
            stream_workgroup: 0,
            paged: true,
        }
    }
}

impl AttentionConfig {
    /// The contiguous-KV baseline of these kernels (the bench's).
    #[doc(hidden)]
    pub fn contiguous(mut self) -> Self {
        self.paged = false;
        self
    }

    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// With the decode kernel `kernel`.
    pub fn kernel(mut self, kernel: Kernel) -> Self {
        self.kernel = Some(kernel);
        self
    }

    /// With cascade segments of at most `tokens` on the rows kernel.
    pub fn cascade_chunk_tokens(mut self, tokens: u32) -> Self {
        self.cascade_chunk_tokens = tokens;
        self
    }

    /// With the attention kernels' shader runtime checks as `checks` says.
    pub fn shader_checks(mut self, checks: ShaderChecks) -> Self {
        self.shader_checks = checks;
        self
    }

    /// With the `stream` kernel's step: `unroll` tokens per lane group
    /// (1, 2, 4) and `workgroup` invocations (64, 128, 256); 0 leaves either
    /// to the kernel. A step the device cannot run is refused by
    /// [`PagedAttention::new`].
    pub fn stream_step(mut self, unroll: u32, workgroup: u32) -> Self {
        self.stream_unroll = unroll;
        self.stream_workgroup = workgroup;
        self
    }
}

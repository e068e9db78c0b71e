//! The environment variables of the command line. The library reads none:
//! the CLI reads these here and passes what they say.
//!
//! - `PAGEDATTN_BACKEND`: `vulkan`, `gl`, `metal`, `dx12`, `webgpu` or `all`
//!   (the default): the backends an adapter is opened on.
//! - `PAGEDATTN_KERNEL`: `tiled`, `lanes` or `serial`: the decode kernel,
//!   over the tuner's pick.
//! - `PAGEDATTN_TUNE_CACHE`: a file the tuner keeps its picks in across runs.
//! - `PAGEDATTN_MODEL`: the model file of `generate`, `serve`, `loadgen`
//!   and `bench --only model`.

use pagedattn::gpu::{parse_backends, AttentionConfig, Gpu, GpuError, Kernel, Tuner};
use std::env::VarError;

/// The backends `PAGEDATTN_BACKEND` names (all when unset); a value that
/// names none, or is not UTF-8, is an error naming it.
pub fn backends() -> Result<wgpu::Backends, GpuError> {
    backends_from(std::env::var("PAGEDATTN_BACKEND"))
}

fn backends_from(var: Result<String, VarError>) -> Result<wgpu::Backends, GpuError> {
    match var {
        Ok(name) => parse_backends(&name),
        Err(VarError::NotPresent) => Ok(wgpu::Backends::all()),
        Err(VarError::NotUnicode(v)) => {
            Err(GpuError::UnknownBackend(v.to_string_lossy().into_owned()))
        }
    }
}

/// The model file: `PAGEDATTN_MODEL` if set and not empty, else the one
/// default (`<repo>/models/...`, where `scripts/fetch-model.sh` puts it).
pub fn model_path() -> std::path::PathBuf {
    match std::env::var_os("PAGEDATTN_MODEL") {
        Some(p) if !p.is_empty() => std::path::PathBuf::from(p),
        _ => pagedattn_model::config::default_model_path(),
    }
}

/// The default adapter of [`backends`].
pub fn gpu() -> Result<Gpu, GpuError> {
    Gpu::with_backends(backends()?)
}

/// `PAGEDATTN_KERNEL`, if set: `Ok(None)` when unset or blank; an error
/// for a value that names no kernel, non-UTF-8 values included.
pub fn kernel() -> Result<Option<Kernel>, String> {
    kernel_from(std::env::var("PAGEDATTN_KERNEL"))
}

fn kernel_from(var: Result<String, VarError>) -> Result<Option<Kernel>, String> {
    let names = || Kernel::ALL.map(Kernel::name).join(", ");
    match var {
        Ok(v) if !v.trim().is_empty() => Kernel::from_name(&v)
            .map(Some)
            .ok_or_else(|| format!("PAGEDATTN_KERNEL={v}: not a kernel (one of {})", names())),
        Err(VarError::NotUnicode(v)) => Err(format!(
            "PAGEDATTN_KERNEL={}: not UTF-8, so not a kernel (one of {})",
            v.to_string_lossy(),
            names()
        )),
        _ => Ok(None),
    }
}

/// A tuner keeping its picks in `PAGEDATTN_TUNE_CACHE` when that names a
/// file, in memory otherwise.
pub fn tuner() -> Tuner {
    match std::env::var_os("PAGEDATTN_TUNE_CACHE") {
        Some(p) if !p.is_empty() => Tuner::with_file(p),
        _ => Tuner::new(),
    }
}

/// The attention configuration: `PAGEDATTN_KERNEL` when set, else
/// `tuned` (the tuner's pick), else the adapter's default.
pub fn attention_config(tuned: Option<Kernel>) -> Result<AttentionConfig, String> {
    Ok(match kernel()?.or(tuned) {
        Some(k) => AttentionConfig::new().kernel(k),
        None => AttentionConfig::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every value names a kernel or a backend, or is refused: non-UTF-8
    /// ones too (they were once silently ignored); unset or blank means none.
    #[test]
    fn values_are_names_or_errors() {
        #[cfg(unix)]
        {
            use std::os::unix::ffi::OsStringExt;
            let bad = std::ffi::OsString::from_vec(vec![b's', 0xff, b'l']);
            let e = kernel_from(Err(VarError::NotUnicode(bad))).unwrap_err();
            assert!(e.contains("not UTF-8"), "{e}");
            let bad = std::ffi::OsString::from_vec(vec![b'v', b'k', 0xfe]);
            let r = backends_from(Err(VarError::NotUnicode(bad)));
            assert!(matches!(r, Err(GpuError::UnknownBackend(_))), "{r:?}");
        }
        assert_eq!(kernel_from(Err(VarError::NotPresent)), Ok(None));
        assert_eq!(kernel_from(Ok(" ".into())), Ok(None));
        assert_eq!(kernel_from(Ok("serial".into())), Ok(Some(Kernel::Serial)));
        assert!(kernel_from(Ok("lanes-f16".into())).is_err(), "removed");
        assert_eq!(backends_from(Ok("GL".into())), Ok(wgpu::Backends::GL));
        assert_eq!(
            backends_from(Err(VarError::NotPresent)),
            Ok(wgpu::Backends::all())
        );
        assert!(backends_from(Ok("voodoo".into())).is_err());
    }
}

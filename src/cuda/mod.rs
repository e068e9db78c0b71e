//! The `cuda` feature: the decode, write_kv and copy_blocks kernels in CUDA C
//! (`kernels.cu`), compiled at run time by NVRTC through cudarc, over the
//! same pool layout `[num_blocks][num_kv_heads][block_size][head_dim]` and
//! the same CSR block tables as the WGSL kernels. It exists for parity on
//! NVIDIA hardware (same inputs, same answers) and as a speed yardstick.
//!
//! The driver (`libcuda.so.1`) and NVRTC (`libnvrtc.so*`) are opened at run
//! time, so building needs neither. cudarc panics when it cannot open them,
//! so [`Cuda::new`] first probes for both with `dlopen` and returns
//! [`CudaError::NoDriver`] / [`CudaError::NoNvrtc`] instead; every later
//! call into cudarc is guarded so that a panic inside it (a driver older than
//! the CUDA 13.0 bindings lacks symbols) becomes [`CudaError::Panicked`].
//!
//! ```no_run
//! # fn main() -> Result<(), pagedattn::cuda::CudaError> {
//! use pagedattn::cuda::Cuda;
//! match Cuda::new(0) {
//!     Ok(cuda) => println!("{}", cuda.describe()),
//!     Err(e) if e.is_unavailable() => println!("CUDA: {e}"),
//!     Err(e) => return Err(e),
//! }
//! # Ok(())
//! # }
//! ```

mod bench;
mod cache;
mod decode;

pub use bench::{bench_decode, DecodeBench, DecodeTiming};
pub use cache::CudaKvCache;
pub use decode::CudaAttention;

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CString};
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys as cu, CudaContext, CudaModule, CudaStream, DriverError};
use cudarc::nvrtc::{self, result::NvrtcError, sys::nvrtcResult, Ptx};

use crate::gpu::KvDtype;

/// The CUDA C source of every kernel.
pub const KERNELS_CU: &str = include_str!("kernels.cu");

/// Everything the CUDA path reports instead of panicking.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// The NVIDIA driver library could not be opened (no driver installed).
    #[error("no driver found ({lib} missing)")]
    NoDriver {
        /// The library looked for, e.g. `libcuda.so.1`.
        lib: &'static str,
        /// Every file name tried.
        tried: Vec<String>,
    },
    /// The driver is there but NVRTC (part of the CUDA toolkit, not the
    /// driver) is not.
    #[error("NVRTC not found (tried {tried:?}): install the CUDA toolkit's libnvrtc or put its folder on LD_LIBRARY_PATH")]
    NoNvrtc {
        /// Every file name tried.
        tried: Vec<String>,
    },
    /// The driver loaded but offers no usable device.
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// A driver call failed.
    #[error("CUDA driver error in {what}: {message}")]
    Driver {
        /// What was being done.
        what: String,
        /// The driver's error code and text.
        message: String,
    },
    /// NVRTC rejected the kernel source.
    #[error("NVRTC could not compile the kernels with {options:?}: {message}\n{log}")]
    Compile {
        /// Options given to NVRTC.
        options: Vec<String>,
        /// NVRTC's error code.
        message: String,
        /// The compiler log.
        log: String,
    },
    /// cudarc panicked (most likely a symbol missing from an older driver or
    /// NVRTC than the CUDA 13.0 bindings expect).
    #[error("cudarc panicked in {what}: {message}")]
    Panicked {
        /// What was being done.
        what: String,
        /// The panic message.
        message: String,
    },
    /// A shape the CUDA kernels do not support.
    #[error("unsupported configuration: {0}")]
    Unsupported(String),
    /// An argument of the wrong size or value.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl CudaError {
    /// True when CUDA is simply not there (no driver, no NVRTC, no device):
    /// tests skip on these and fail on anything else.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            CudaError::NoDriver { .. } | CudaError::NoNvrtc { .. } | CudaError::NoDevice(_)
        )
    }

    pub(crate) fn driver(what: &str, e: DriverError) -> Self {
        CudaError::Driver {
            what: what.to_string(),
            message: format!("{e:?}"),
        }
    }
}

/// Shorthand for mapping a cudarc driver result.
pub(crate) trait DriverResultExt<T> {
    fn during(self, what: &str) -> Result<T, CudaError>;
}

impl<T> DriverResultExt<T> for Result<T, DriverError> {
    fn during(self, what: &str) -> Result<T, CudaError> {
        self.map_err(|e| CudaError::driver(what, e))
    }
}

/// Runs `f`, turning a panic inside cudarc into [`CudaError::Panicked`].
pub(crate) fn guarded<T>(
    what: &str,
    f: impl FnOnce() -> Result<T, CudaError>,
) -> Result<T, CudaError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        Err(CudaError::Panicked {
            what: what.to_string(),
            message,
        })
    })
}

/// The shared libraries the probe opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Libraries {
    /// The driver library file name.
    pub driver: String,
    /// The NVRTC library file name.
    pub nvrtc: String,
}

/// File names to try for `lib`: each is one that cudarc 0.18 (built with
/// `cuda-13000`) also tries, so whatever this finds, cudarc finds too.
fn candidates(lib: &str) -> Vec<String> {
    use std::env::consts::{DLL_PREFIX as P, DLL_SUFFIX as S};
    vec![
        format!("{P}{lib}{S}.1"),
        format!("{P}{lib}{S}.13"),
        format!("{P}{lib}{S}"),
        format!("{P}{lib}64_13{S}"),
        format!("{P}{lib}64_130_0{S}"),
    ]
}

fn first_loadable(names: &[String]) -> Option<String> {
    names.iter().find_map(|n| {
        // SAFETY: loading runs the library's initialisers; the driver's and
        // NVRTC's are what cudarc would run a moment later anyway.
        unsafe { libloading::Library::new(n) }
            .ok()
            .map(|_| n.clone())
    })
}

/// Looks for the driver and NVRTC without calling into cudarc (which panics
/// when they are missing). Safe to call on any machine.
pub fn probe() -> Result<Libraries, CudaError> {
    let lib = if cfg!(windows) {
        "nvcuda.dll"
    } else {
        "libcuda.so.1"
    };
    let mut tried = candidates("cuda");
    if cfg!(windows) {
        tried.extend(candidates("nvcuda"));
    }
    let driver = first_loadable(&tried).ok_or(CudaError::NoDriver { lib, tried })?;
    let tried = candidates("nvrtc");
    let nvrtc = first_loadable(&tried).ok_or(CudaError::NoNvrtc { tried })?;
    Ok(Libraries { driver, nvrtc })
}

/// The compile-time shape of a kernel module (the macros of `kernels.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Shape {
    pub head_dim: u32,
    pub group: u32,
    pub block_size: u32,
    pub dtype: KvDtype,
}

impl Shape {
    /// Lanes per token of decode, as the WGSL lanes kernel chooses them on
    /// a device with subgroups of 32 or more.
    pub fn lanes_per_token(&self) -> u32 {
        crate::gpu::shader::lanes_per_token(self.head_dim, 8)
    }

    /// Query heads per block (head tile), as the WGSL lanes kernel.
    pub fn head_tile(&self) -> u32 {
        let jn = (self.head_dim / 4 / self.lanes_per_token()).max(1);
        crate::gpu::shader::balanced_head_tile(self.group, (32 / jn).clamp(1, 8))
    }

    /// Head tiles per KV head.
    pub fn head_tiles(&self) -> u32 {
        self.group.max(1).div_ceil(self.head_tile())
    }
}

/// A CUDA device with a context, its default stream and the kernel modules
/// compiled so far (one per shape).
pub struct Cuda {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    compute_capability: (i32, i32),
    sm_count: u32,
    driver_version: i32,
    nvrtc_version: (i32, i32),
    libraries: Libraries,
    modules: Mutex<HashMap<Shape, Arc<CudaModule>>>,
}

impl Cuda {
    /// Opens device `ordinal`. Errors with [`CudaError::is_unavailable`] set
    /// when there is no driver, no NVRTC or no device; never panics.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        let libraries = probe()?;
        guarded("opening the device", || {
            let ctx = CudaContext::new(ordinal).map_err(|e| match e.0 {
                cu::CUresult::CUDA_ERROR_NO_DEVICE | cu::CUresult::CUDA_ERROR_INVALID_DEVICE => {
                    CudaError::NoDevice(format!("device {ordinal}: {e:?}"))
                }
                cu::CUresult::CUDA_ERROR_STUB_LIBRARY => CudaError::NoDevice(format!(
                    "{} is the CUDA toolkit's stub, not the driver (take the stubs folder off LD_LIBRARY_PATH)",
                    libraries.driver
                )),
                _ => CudaError::driver("cuInit / context creation", e),
            })?;
            let name = ctx.name().during("cuDeviceGetName")?;
            let compute_capability = ctx.compute_capability().during("compute capability")?;
            let sm_count = ctx
                .attribute(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .during("multiprocessor count")?
                .max(1) as u32;
            let mut driver_version: c_int = 0;
            // SAFETY: a plain out-parameter query.
            unsafe { cu::cuDriverGetVersion(&mut driver_version) }
                .result()
                .during("cuDriverGetVersion")?;
            let (mut maj, mut min): (c_int, c_int) = (0, 0);
            // SAFETY: plain out-parameter queries.
            unsafe { nvrtc::sys::nvrtcVersion(&mut maj, &mut min) }
                .result()
                .map_err(|e| nvrtc_error(&[], e, String::new()))?;
            let stream = ctx.default_stream();
            Ok(Self {
                ctx,
                stream,
                name,
                compute_capability,
                sm_count,
                driver_version,
                nvrtc_version: (maj, min),
                libraries,
                modules: Mutex::new(HashMap::new()),
            })
        })
    }

    /// "name (sm_XY, driver A.B, NVRTC C.D)", for logs and reports.
    pub fn describe(&self) -> String {
        let (maj, min) = self.compute_capability;
        format!(
            "{} (sm_{maj}{min}, driver CUDA {}.{}, NVRTC {}.{}, {} + {})",
            self.name,
            self.driver_version / 1000,
            self.driver_version % 1000 / 10,
            self.nvrtc_version.0,
            self.nvrtc_version.1,
            self.libraries.driver,
            self.libraries.nvrtc
        )
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// (major, minor) compute capability.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// Waits for all work queued on the stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        guarded("synchronize", || {
            self.stream.synchronize().during("synchronize")
        })
    }

    /// Streaming multiprocessors (`Split::Auto` fills them once).
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The kernel module for `shape`, compiled on first use.
    pub(crate) fn module(&self, shape: Shape) -> Result<Arc<CudaModule>, CudaError> {
        let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = modules.get(&shape) {
            return Ok(m.clone());
        }
        let m = guarded("compiling the kernels", || self.compile(&shape))?;
        modules.insert(shape, m.clone());
        Ok(m)
    }

    fn compile(&self, shape: &Shape) -> Result<Arc<CudaModule>, CudaError> {
        let defines = vec![
            format!("-DHEAD_DIM={}", shape.head_dim),
            format!("-DGROUP={}", shape.group),
            format!("-DBLOCK_SIZE={}", shape.block_size),
            format!("-DKV_F16={}", (shape.dtype == KvDtype::F16) as u32),
            format!("-DLPT={}", shape.lanes_per_token()),
            format!("-DHT={}", shape.head_tile()),
        ];
        // Machine code for this very GPU: the driver loads a cubin from a
        // newer NVRTC of the same major version, whereas PTX from a newer
        // NVRTC than the driver is refused (CUDA_ERROR_UNSUPPORTED_PTX_VERSION).
        let (maj, min) = self.compute_capability;
        let mut options = vec![format!("--gpu-architecture=sm_{maj}{min}")];
        options.extend(defines.iter().cloned());
        let image = match nvrtc_build(&options, true) {
            Ok(cubin) => Ptx::from_binary(cubin),
            // An NVRTC older than the GPU does not know its sm_XY: fall back
            // to PTX for NVRTC's default target, which the driver JIT-compiles.
            Err(CudaError::Compile { message, .. })
                if message == format!("{:?}", nvrtcResult::NVRTC_ERROR_INVALID_OPTION) =>
            {
                let ptx = nvrtc_build(&defines, false)?;
                Ptx::from_src(String::from_utf8_lossy(&ptx).into_owned())
            }
            Err(e) => return Err(e),
        };
        self.ctx.load_module(image).during("cuModuleLoadData")
    }
}

/// An NVRTC program, destroyed on drop.
struct Program(nvrtc::sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram and destroyed only here.
        let _ = unsafe { nvrtc::result::destroy_program(self.0) };
    }
}

fn nvrtc_error(options: &[String], e: NvrtcError, log: String) -> CudaError {
    CudaError::Compile {
        options: options.to_vec(),
        message: format!("{:?}", e.0),
        log,
    }
}

fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles [`KERNELS_CU`] with `options`; returns the cubin, or the PTX
/// text when `cubin` is false.
fn nvrtc_build(options: &[String], cubin: bool) -> Result<Vec<u8>, CudaError> {
    let src = CString::new(KERNELS_CU).expect("kernels.cu holds no NUL byte");
    let err = |e: NvrtcError| nvrtc_error(options, e, String::new());
    let prog =
        Program(nvrtc::result::create_program(&src, Some(c"pagedattn_kernels.cu")).map_err(err)?);
    // SAFETY: prog is a live program; the options are copied by NVRTC.
    if let Err(e) = unsafe { nvrtc::result::compile_program(prog.0, options) } {
        // SAFETY: as above; the log exists after a failed compile.
        let log = unsafe { nvrtc::result::get_program_log(prog.0) }
            .map(|l| c_chars_to_string(&l))
            .unwrap_or_default();
        return Err(nvrtc_error(options, e, log));
    }
    if cubin {
        let mut size = 0usize;
        // SAFETY: size query, then a buffer of exactly that size.
        unsafe { nvrtc::sys::nvrtcGetCUBINSize(prog.0, &mut size) }
            .result()
            .map_err(err)?;
        let mut buf = vec![0u8; size];
        unsafe { nvrtc::sys::nvrtcGetCUBIN(prog.0, buf.as_mut_ptr().cast()) }
            .result()
            .map_err(err)?;
        Ok(buf)
    } else {
        // SAFETY: prog compiled successfully.
        let ptx = unsafe { nvrtc::result::get_ptx(prog.0) }.map_err(err)?;
        Ok(c_chars_to_string(&ptx).into_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_names_match_cudarc_patterns() {
        let c = candidates("cuda");
        if cfg!(target_os = "linux") {
            assert_eq!(c[0], "libcuda.so.1");
            assert!(candidates("nvrtc").contains(&"libnvrtc.so.13".to_string()));
        }
    }

    #[test]
    fn missing_driver_is_an_error_not_a_panic() {
        match Cuda::new(0) {
            Ok(c) => eprintln!("CUDA present: {}", c.describe()),
            Err(e) => {
                eprintln!("CUDA: {e}");
                assert!(!matches!(e, CudaError::Panicked { .. }), "{e}");
            }
        }
    }

    #[test]
    fn every_kernel_is_in_the_source() {
        for k in ["write_kv", "copy_blocks", "decode", "merge"] {
            assert!(
                KERNELS_CU.contains(&format!("extern \"C\" __global__ void {k}("))
                    || KERNELS_CU.contains(&format!("__launch_bounds__(NT) {k}(")),
                "{k}"
            );
        }
        assert!(
            !KERNELS_CU
                .lines()
                .any(|l| l.trim_start().starts_with("#include")),
            "NVRTC has no C headers"
        );
    }
}

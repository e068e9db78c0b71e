//! The device: adapter choice, limits, and small buffer helpers.

use super::error::GpuError;

/// A wgpu device and queue, with what the adapter is and allows.
///
/// Two ways to get one:
/// - [`Gpu::new`] (and `from_adapter*`) open a device of their own, asking
///   for the optional features that help (`SHADER_F16`, `SUBGROUP`,
///   `TIMESTAMP_QUERY`, where the adapter has them), and watch it: wgpu's
///   default for an error raised outside an error scope is to panic; such a
///   `Gpu` instead records the first one and reports it from the next
///   [`wait`](Self::wait) or [`take_error`](Self::take_error), and records
///   device loss, after which every call returns [`GpuError::Device`].
/// - [`Gpu::from_device`] borrows an engine's device and queue as they are
///   (wgpu handles are cheap clones): it enables nothing and installs no
///   handler, since the device's uncaptured-error and device-lost callbacks
///   are the engine's. The library's own work still runs in error scopes, so
///   its calls return their own errors. [`watch`](Self::watch) opts in to
///   what `Gpu::new` installs.
///
/// Pipelines are compiled once per (kernel, shape) and shared by every
/// `KvCache` and `PagedAttention` made from clones of one `Gpu`.
/// [`counters`](Self::counters) counts the GPU objects the library created.
#[derive(Clone)]
pub struct Gpu {
    /// The device.
    pub device: wgpu::Device,
    /// Its queue.
    pub queue: wgpu::Queue,
    /// Adapter name, backend, driver.
    pub info: wgpu::AdapterInfo,
    /// Limits the device was opened with (the adapter's own on native).
    pub limits: wgpu::Limits,
    /// Features enabled on the device.
    pub features: wgpu::Features,
    health: std::sync::Arc<Health>,
    pipelines: std::sync::Arc<
        std::sync::Mutex<
            std::collections::HashMap<
                (&'static str, super::compose::PipelineKey),
                wgpu::ComputePipeline,
            >,
        >,
    >,
    counts: std::sync::Arc<Counts>,
    /// The compute units, read on first use (see [`Gpu::compute_units`]).
    units: std::sync::Arc<std::sync::OnceLock<Option<super::units::ComputeUnits>>>,
    /// Held by the library's calls on the GL backend (see [`Gpu::serial`]).
    gl_lock: std::sync::Arc<std::sync::Mutex<()>>,
}

thread_local! {
    /// Whether this thread holds some `Gpu`'s GL lock (the lock is
    /// re-entrant per thread: library calls nest).
    static GL_HELD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Held for the length of a library call on the GL backend; see
/// [`Gpu::serial`].
pub struct Serial<'a> {
    _guard: Option<std::sync::MutexGuard<'a, ()>>,
}

impl Drop for Serial<'_> {
    fn drop(&mut self) {
        if self._guard.is_some() {
            GL_HELD.with(|h| h.set(false));
        }
    }
}

/// GPU objects the library created through one `Gpu` (and its clones), from
/// [`Gpu::counters`]: a steady-state step should add none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Buffers (storage, uniform, readback staging).
    pub buffers: u64,
    /// Bind groups.
    pub bind_groups: u64,
    /// Compute pipelines (each compiled once per kernel and shape).
    pub pipelines: u64,
}

#[derive(Default)]
struct Counts {
    buffers: std::sync::atomic::AtomicU64,
    bind_groups: std::sync::atomic::AtomicU64,
    pipelines: std::sync::atomic::AtomicU64,
}

/// What the device's callbacks recorded.
#[derive(Default)]
struct Health {
    /// Why the device was lost, once it is.
    lost: std::sync::Mutex<Option<String>>,
    /// First error raised outside an error scope and not yet reported.
    uncaptured: std::sync::Mutex<Option<GpuError>>,
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

const NO_ADAPTER_HINT: &str = "install a Vulkan driver (on Linux without a GPU: `apt-get install mesa-vulkan-drivers` for lavapipe), or name a backend this machine has";

/// The backends a name stands for (`vulkan`, `gl`, `metal`, `dx12`,
/// `webgpu`, or `all`/empty for every one), case-insensitive. The library
/// reads no environment variable: the CLI parses `PAGEDATTN_BACKEND` with
/// this and passes the result to [`Gpu::with_backends`].
pub fn parse_backends(name: &str) -> Result<wgpu::Backends, GpuError> {
    Ok(match name.trim().to_ascii_lowercase().as_str() {
        "" | "all" => wgpu::Backends::all(),
        "vulkan" | "vk" => wgpu::Backends::VULKAN,
        "gl" | "gles" | "opengl" => wgpu::Backends::GL,
        "metal" => wgpu::Backends::METAL,
        "dx12" | "d3d12" => wgpu::Backends::DX12,
        "webgpu" | "browser" => wgpu::Backends::BROWSER_WEBGPU,
        _ => return Err(GpuError::UnknownBackend(name.to_string())),
    })
}

/// The backends to try for an adapter among `backends`, in order: a
/// narrower set alone; all of them, the platform's own API first (on Linux
/// Vulkan alone: GL's EGL is not set up for nothing, and the process's one
/// Vulkan instance is shared, which NVIDIA's driver needs: see `instance`),
/// then every backend. For an engine opening its own device the same way.
pub fn adapter_backends(backends: wgpu::Backends) -> Vec<wgpu::Backends> {
    if backends != wgpu::Backends::all() || cfg!(target_arch = "wasm32") {
        return vec![backends];
    }
    let first = if cfg!(any(target_os = "linux", target_os = "android")) {
        wgpu::Backends::VULKAN
    } else {
        wgpu::Backends::PRIMARY
    };
    vec![first, backends]
}

fn instance(backends: wgpu::Backends) -> wgpu::Instance {
    let make = |backends| {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = backends;
        wgpu::Instance::new(desc)
    };
    // Native, with Vulkan: the process keeps one Vulkan instance alive, so
    // the Vulkan loader never unloads the driver. NVIDIA's (580) cannot be
    // loaded again many times in one process: on an H200 the fifth `Gpu` of
    // a test binary found no adapter ("cannot allocate memory in static TLS
    // block" from libnvidia-tls). Vulkan alone (`PAGEDATTN_BACKEND=vulkan`)
    // shares that instance (checked on the H200: every suite passes); with
    // other backends each `Gpu` still gets its own instance, since an
    // instance shared across threads trips GL's EGL context (BadAccess).
    #[cfg(not(target_arch = "wasm32"))]
    if backends.contains(wgpu::Backends::VULKAN) {
        static VULKAN: std::sync::OnceLock<wgpu::Instance> = std::sync::OnceLock::new();
        let vk = VULKAN.get_or_init(|| make(wgpu::Backends::VULKAN));
        if backends == wgpu::Backends::VULKAN {
            return vk.clone();
        }
    }
    make(backends)
}

impl Gpu {
    /// Opens the default adapter (highest performance, the platform's own
    /// API first), blocking. Native only.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new() -> Result<Self, GpuError> {
        Self::with_backends(wgpu::Backends::all())
    }

    /// Opens the default adapter among `backends` (see
    /// [`parse_backends`]), blocking. Native only.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn with_backends(backends: wgpu::Backends) -> Result<Self, GpuError> {
        pollster::block_on(Self::with_backends_async(backends))
    }

    /// Opens the default adapter.
    pub async fn new_async() -> Result<Self, GpuError> {
        Self::with_backends_async(wgpu::Backends::all()).await
    }

    /// Opens the default adapter among `backends`.
    pub async fn with_backends_async(backends: wgpu::Backends) -> Result<Self, GpuError> {
        let opts = wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            force_fallback_adapter: false,
            ..Default::default()
        };
        for b in adapter_backends(backends) {
            if let Ok(adapter) = instance(b).request_adapter(&opts).await {
                return Self::from_adapter(adapter).await;
            }
        }
        Err(GpuError::NoAdapter {
            backend: (backends != wgpu::Backends::all()).then(|| format!("{backends:?}")),
            hint: NO_ADAPTER_HINT,
        })
    }

    /// Every adapter of `backends`, opened. Native only.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn all(backends: wgpu::Backends) -> Vec<Result<Self, GpuError>> {
        let inst = instance(backends);
        let adapters = pollster::block_on(inst.enumerate_adapters(backends));
        adapters
            .into_iter()
            .map(|a| pollster::block_on(Self::from_adapter(a)))
            .collect()
    }

    /// Opens a device on `adapter` with the adapter's own limits (the
    /// browser's defaults on the web) and the optional features that help.
    pub async fn from_adapter(adapter: wgpu::Adapter) -> Result<Self, GpuError> {
        let limits = if cfg!(target_arch = "wasm32") {
            wgpu::Limits::default().using_resolution(adapter.limits())
        } else {
            adapter.limits()
        };
        Self::from_adapter_with_limits(adapter, limits).await
    }

    /// Opens a device on `adapter` with the given limits (at most the
    /// adapter's own): e.g. the browser's defaults on a native adapter, to
    /// see how a configuration fares on the web.
    pub async fn from_adapter_with_limits(
        adapter: wgpu::Adapter,
        limits: wgpu::Limits,
    ) -> Result<Self, GpuError> {
        let info = adapter.get_info();
        let features = adapter.features()
            & (wgpu::Features::TIMESTAMP_QUERY
                | wgpu::Features::SHADER_F16
                | wgpu::Features::SUBGROUP);
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("pagedattn"),
                required_features: features,
                required_limits: limits.clone(),
                experimental_features: wgpu::ExperimentalFeatures::disabled(),
                memory_hints: wgpu::MemoryHints::Performance,
                trace: wgpu::Trace::Off,
            })
            .await
            .map_err(|e| GpuError::RequestDevice {
                adapter: info.name.clone(),
                reason: e.to_string(),
            })?;
        let gpu = Self {
            device,
            queue,
            info,
            limits,
            features,
            health: Default::default(),
            pipelines: Default::default(),
            counts: Default::default(),
            units: Default::default(),
            gl_lock: Default::default(),
        };
        gpu.watch();
        Ok(gpu)
    }

    /// Borrows an engine's device and queue (clones of its handles): the
    /// library enables no feature, installs no handler and uses the device's
    /// own limits and features. Its calls run their work in error scopes and
    /// return their own errors; device loss is seen by the library only
    /// after [`watch`](Self::watch) (or when a call fails because of it).
    pub fn from_device(device: &wgpu::Device, queue: &wgpu::Queue) -> Self {
        Self {
            info: device.adapter_info(),
            limits: device.limits(),
            features: device.features(),
            device: device.clone(),
            queue: queue.clone(),
            health: Default::default(),
            pipelines: Default::default(),
            counts: Default::default(),
            units: Default::default(),
            gl_lock: Default::default(),
        }
    }

    /// The device's compute units (NVIDIA SMs, AMD CUs), which wgpu does
    /// not report: from the Vulkan driver where it says
    /// (`VK_NV_shader_sm_builtins`, `VK_AMD_shader_core_properties`), else
    /// from the table of known adapters (`units.rs`) by name; `None` for
    /// software adapters and the unknown. `Split::Auto` fills the device
    /// from this count where it has one.
    pub fn compute_units(&self) -> Option<super::units::ComputeUnits> {
        *self.units.get_or_init(|| {
            if self.is_software() {
                None
            } else {
                super::units::query(&self.device, &self.info)
            }
        })
    }

    /// Installs the device's uncaptured-error and device-lost callbacks (what
    /// [`Gpu::new`] does): errors raised outside any scope are recorded for
    /// [`take_error`](Self::take_error) instead of wgpu's default panic, and
    /// loss is recorded for every call. Replaces any callbacks the device
    /// had: for a borrowed device, only if the engine wants the library to
    /// own them.
    pub fn watch(&self) {
        let h = self.health.clone();
        self.device
            .on_uncaptured_error(std::sync::Arc::new(move |e: wgpu::Error| {
                lock(&h.uncaptured).get_or_insert_with(|| e.into());
            }));
        let h = self.health.clone();
        self.device.set_device_lost_callback(move |reason, msg| {
            *lock(&h.lost) = Some(format!("device lost ({reason:?}): {msg}"));
        });
    }

    /// On the GL backend, serialises the library's calls across threads:
    /// wgpu's GLES backend gives a call one second to take the GL context
    /// and panics after that, and on software GL one shader compile holds
    /// it for longer. Other backends: a no-op. Re-entrant on one thread.
    pub fn serial(&self) -> Serial<'_> {
        if self.info.backend != wgpu::Backend::Gl || GL_HELD.with(|h| h.get()) {
            return Serial { _guard: None };
        }
        let g = lock(&self.gl_lock);
        GL_HELD.with(|h| h.set(true));
        Serial { _guard: Some(g) }
    }

    /// GPU objects the library created so far through this `Gpu` and its
    /// clones.
    pub fn counters(&self) -> Counters {
        use std::sync::atomic::Ordering::Relaxed;
        Counters {
            buffers: self.counts.buffers.load(Relaxed),
            bind_groups: self.counts.bind_groups.load(Relaxed),
            pipelines: self.counts.pipelines.load(Relaxed),
        }
    }

    pub(crate) fn count_buffer(&self) {
        self.counts
            .buffers
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn count_bind_group(&self) {
        self.counts
            .bind_groups
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The pipeline of `kernel` for `shape` from the shared cache, made by
    /// `make` on first use.
    pub(crate) fn cached_pipeline(
        &self,
        kernel: &'static str,
        shape: super::compose::PipelineKey,
        make: impl FnOnce() -> Result<wgpu::ComputePipeline, GpuError>,
    ) -> Result<wgpu::ComputePipeline, GpuError> {
        if let Some(p) = lock(&self.pipelines).get(&(kernel, shape)) {
            return Ok(p.clone());
        }
        let p = make()?;
        self.counts
            .pipelines
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(lock(&self.pipelines)
            .entry((kernel, shape))
            .or_insert(p)
            .clone())
    }

    /// Whether the device has been lost (destroyed, reset, or its driver gone).
    ///
    /// Polls the device first (without blocking), so that a loss wgpu has
    /// noticed but not yet announced (e.g. `device.destroy()` from another
    /// thread) is seen at once.
    pub fn is_lost(&self) -> bool {
        self.alive().is_err()
    }

    /// `Err(GpuError::Device)` once the device is lost, else `Ok`. Every
    /// public call of the library checks this first. Never reports errors
    /// raised outside the library's scopes (that is
    /// [`take_error`](Self::take_error)'s job).
    pub fn alive(&self) -> Result<(), GpuError> {
        let _serial = self.serial();
        if let Some(why) = lock(&self.health.lost).clone() {
            return Err(GpuError::Device(why));
        }
        // A non-blocking poll runs wgpu's device-lost callback when the
        // device was destroyed (wgpu calls it from poll, not from destroy).
        #[cfg(not(target_arch = "wasm32"))]
        {
            let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.device.poll(wgpu::PollType::Poll)
            }));
            if polled.is_err() {
                self.mark_lost("device lost: wgpu failed to poll it");
            }
        }
        match lock(&self.health.lost).clone() {
            Some(why) => Err(GpuError::Device(why)),
            None => Ok(()),
        }
    }

    /// Whether the device still makes valid objects: a 4-byte buffer made
    /// and written inside a validation scope (both fail on a destroyed
    /// device, whether or not its loss was announced yet).
    #[cfg(not(target_arch = "wasm32"))]
    fn device_answers(&self) -> bool {
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let probe = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("liveness probe"),
            size: 4,
            usage: wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.queue.write_buffer(&probe, 0, &[0; 4]);
        pollster::block_on(scope.pop()).is_none()
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn mark_lost(&self, why: &str) {
        lock(&self.health.lost).get_or_insert_with(|| why.to_string());
    }

    /// `Err(GpuError::Device)` once the device is lost; else the first error
    /// wgpu raised outside an error scope since the last call, if any
    /// (taking it); else `Ok`.
    pub fn take_error(&self) -> Result<(), GpuError> {
        self.alive()?;
        match lock(&self.health.uncaptured).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// "name (backend)", for logs and test names.
    pub fn describe(&self) -> String {
        format!("{} ({:?})", self.info.name, self.info.backend)
    }

    /// Whether the adapter is known to end long loops early: llvmpipe
    /// (lavapipe on Vulkan, and on GL) stops every loop of an invocation
    /// after 65535 iterations in total, silently.
    pub fn caps_loops(&self) -> bool {
        self.info.name.to_ascii_lowercase().contains("llvmpipe")
    }

    /// Whether the adapter runs shaders on the CPU (llvmpipe/lavapipe,
    /// SwiftShader, WARP): barriers and gathers cost more than arithmetic
    /// there, so the barrier-free decode kernel is its default.
    pub fn is_software(&self) -> bool {
        let name = self.info.name.to_ascii_lowercase();
        self.info.device_type == wgpu::DeviceType::Cpu
            || [
                "llvmpipe",
                "swiftshader",
                "warp",
                "basic render",
                "lavapipe",
            ]
            .iter()
            .any(|s| name.contains(s))
    }

    /// On an adapter that [caps loops](Self::caps_loops), the most tokens
    /// one attention pass (a workgroup over one sequence's context or
    /// partition) may walk at `head_dim` and still finish: measured on
    /// llvmpipe with margin (`tests/gpu/adversarial_gpu.rs` checks the bound).
    /// `None` elsewhere.
    pub fn max_tokens_per_pass(&self, head_dim: u32) -> Option<u32> {
        self.caps_loops()
            .then_some(if head_dim > 128 { 8192 } else { 16384 })
    }

    /// Refuses, naming the limit, a device whose `limits` fall short of
    /// what the library's kernels need: checked by `KvCache::new` and
    /// `PagedAttention::new` before anything is created, so a small device
    /// gets [`GpuError::DeviceLimit`], not a wgpu validation error.
    pub(crate) fn require_limits(&self, storage_buffers: u32) -> Result<(), GpuError> {
        let l = &self.limits;
        let needs: [(&'static str, u64, u64); 4] = [
            (
                "max_storage_buffers_per_shader_stage",
                storage_buffers as u64,
                l.max_storage_buffers_per_shader_stage as u64,
            ),
            // Every write, copy and attention kernel runs 64 invocations a
            // workgroup (some kernels more; those are eligible only where
            // they fit).
            (
                "max_compute_invocations_per_workgroup",
                64,
                l.max_compute_invocations_per_workgroup as u64,
            ),
            (
                "max_compute_workgroup_size_x",
                64,
                l.max_compute_workgroup_size_x as u64,
            ),
            (
                "max_uniform_buffers_per_shader_stage",
                1,
                l.max_uniform_buffers_per_shader_stage as u64,
            ),
        ];
        match needs.iter().find(|(_, need, have)| have < need) {
            Some(&(limit, needed, available)) => Err(GpuError::DeviceLimit {
                limit,
                needed,
                available,
            }),
            None => Ok(()),
        }
    }

    /// Largest bytes one storage binding may address.
    pub fn max_binding_bytes(&self) -> u64 {
        self.limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size)
    }

    /// A storage buffer holding `data` (at least 16 bytes: zero-sized
    /// bindings are invalid, so empty inputs get a zeroed buffer).
    ///
    /// Filled through the queue rather than mapped at creation: mapping a
    /// buffer of a lost device panics inside wgpu.
    pub fn storage_init<T: bytemuck::Pod>(
        &self,
        label: &str,
        data: &[T],
    ) -> Result<wgpu::Buffer, GpuError> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let buf = self.storage(label, bytes.len() as u64)?;
        if bytes.is_empty() {
            // wgpu zero-initialises new buffers.
        } else if bytes.len().is_multiple_of(4) {
            self.queue.write_buffer(&buf, 0, bytes);
        } else {
            let mut padded = bytes.to_vec();
            padded.resize(bytes.len().next_multiple_of(4), 0);
            self.queue.write_buffer(&buf, 0, &padded);
        }
        Ok(buf)
    }

    /// A uniform buffer holding `value` (written through the queue, never
    /// mapped at creation).
    pub fn uniform<T: bytemuck::Pod>(
        &self,
        label: &str,
        value: &T,
    ) -> Result<wgpu::Buffer, GpuError> {
        let _serial = self.serial();
        self.alive()?;
        let bytes = bytemuck::bytes_of(value);
        self.count_buffer();
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: (bytes.len() as u64).max(16).next_multiple_of(16),
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.queue.write_buffer(&buf, 0, bytes);
        Ok(buf)
    }

    /// An uninitialised storage buffer of `bytes` (at least 16, rounded up to
    /// a multiple of 4). A size over the device's `max_buffer_size` is
    /// refused here, naming the limit, before wgpu sees it; a lost device is
    /// `GpuError::Device`.
    pub fn storage(&self, label: &str, bytes: u64) -> Result<wgpu::Buffer, GpuError> {
        self.buffer(
            label,
            bytes.max(16),
            wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
        )
    }

    /// A buffer of `bytes` rounded up to a multiple of 4 (at least 4),
    /// refused past the device's `max_buffer_size`, naming the limit.
    fn buffer(
        &self,
        label: &str,
        bytes: u64,
        usage: wgpu::BufferUsages,
    ) -> Result<wgpu::Buffer, GpuError> {
        let _serial = self.serial();
        self.alive()?;
        let size = bytes
            .max(4)
            .checked_next_multiple_of(4)
            .filter(|&s| s <= self.limits.max_buffer_size)
            .ok_or(GpuError::DeviceLimit {
                limit: "max_buffer_size",
                needed: bytes,
                available: self.limits.max_buffer_size,
            })?;
        self.count_buffer();
        Ok(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage,
            mapped_at_creation: false,
        }))
    }

    /// Waits for all submitted work, then reports what
    /// [`take_error`](Self::take_error) does. Never polls a lost device
    /// (wgpu panics on that).
    pub fn wait(&self) -> Result<(), GpuError> {
        self.take_error()?;
        self.wait_own()?;
        self.take_error()
    }

    /// Waits for all submitted work and reports only device loss: what the
    /// library's own calls use, so that an error raised by someone else's
    /// work outside any scope (another thread's encoder, say) is never
    /// returned from a call that did not cause it.
    pub(crate) fn wait_own(&self) -> Result<(), GpuError> {
        let _serial = self.serial();
        self.alive()?;
        #[cfg(not(target_arch = "wasm32"))]
        {
            let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.device.poll(wgpu::PollType::wait_indefinitely())
            }));
            match polled {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(GpuError::Device(e.to_string())),
                Err(_) => self.mark_lost("device lost: wgpu failed to wait for it"),
            }
        }
        self.alive()
    }

    /// Reads `bytes` bytes of `buf` back to the host as `T`s (blocking: native only).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read<T: bytemuck::Pod>(
        &self,
        buf: &wgpu::Buffer,
        bytes: u64,
    ) -> Result<Vec<T>, GpuError> {
        let _serial = self.serial();
        pollster::block_on(self.read_async(buf, bytes))
    }

    /// A staging buffer to read back (`MAP_READ | COPY_DST`) of `bytes`,
    /// checked against the device's `max_buffer_size`.
    pub(crate) fn staging(&self, label: &str, bytes: u64) -> Result<wgpu::Buffer, GpuError> {
        self.buffer(
            label,
            bytes,
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        )
    }

    /// Maps a `MAP_READ` buffer once the queue's work is done and reads its
    /// first `bytes` bytes as `T`s, then unmaps it: an engine's own
    /// staging buffer, read without blocking the thread (natively it waits
    /// for the queue; in a browser the map resolves on the event loop).
    pub async fn map_read<T: bytemuck::Pod>(
        &self,
        staging: &wgpu::Buffer,
        bytes: u64,
    ) -> Result<Vec<T>, GpuError> {
        if bytes > staging.size() {
            return Err(GpuError::ReadPastEnd {
                bytes,
                buffer: staging.size(),
            });
        }
        let (tx, rx) = futures_channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| tx.send(r));
        #[cfg(not(target_arch = "wasm32"))]
        self.wait_own()?;
        rx.recv()
            .await
            .map_err(|e| GpuError::Device(format!("readback failed: {e}")))?;
        let out = {
            let view = staging
                .get_mapped_range(..)
                .map_err(|e| GpuError::Device(format!("readback map failed: {e}")))?;
            bytemuck::cast_slice::<u8, T>(&view[..bytes as usize / size_of::<T>() * size_of::<T>()])
                .to_vec()
        };
        staging.unmap();
        Ok(out)
    }

    /// Reads `bytes` bytes of `buf` back as `T`s, without blocking the thread
    /// (the path the browser uses).
    pub async fn read_async<T: bytemuck::Pod>(
        &self,
        buf: &wgpu::Buffer,
        bytes: u64,
    ) -> Result<Vec<T>, GpuError> {
        self.alive()?;
        let want = bytes;
        let bytes = bytes
            .checked_next_multiple_of(4)
            .filter(|&b| b <= buf.size())
            .ok_or(GpuError::ReadPastEnd {
                bytes: want,
                buffer: buf.size(),
            })?;
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let staging = self.staging("readback", bytes)?;
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(buf, 0, &staging, 0, bytes);
        self.queue.submit([enc.finish()]);
        self.map_read(&staging, bytes).await
    }

    /// Runs `f` inside a validation + out-of-memory error scope and returns
    /// the first error wgpu reported as ours (and `GpuError::Device` if the
    /// device is lost, whose errors no scope sees).
    pub async fn scoped<R>(&self, f: impl FnOnce() -> R) -> Result<R, GpuError> {
        self.alive()?;
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let val = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let r = f();
        // Both popped (innermost first) before awaiting, so no scope guard
        // (which is !Send) lives across an await.
        let (ve, oe) = (val.pop(), oom.pop());
        let (ve, oe) = (ve.await, oe.await);
        self.alive()?;
        match ve.or(oe) {
            Some(e) => {
                // A device destroyed mid-call makes its objects invalid
                // before wgpu announces the loss (it does so once the queue
                // is idle): drain it and look again, so the caller learns
                // of the loss rather than of its symptom.
                #[cfg(not(target_arch = "wasm32"))]
                {
                    self.wait_own()?;
                    // An object made on a device another thread destroyed
                    // is invalid at once, while the loss may be announced
                    // later: a write to a fresh buffer fails the same way
                    // only on a dead device.
                    if matches!(&e, wgpu::Error::Validation { .. }) && !self.device_answers() {
                        self.mark_lost("device lost: its new objects are invalid");
                        return Err(GpuError::Device(
                            "device lost: its new objects are invalid".into(),
                        ));
                    }
                }
                Err(e.into())
            }
            None => Ok(r),
        }
    }

    /// Runs fallible GPU work inside the error scopes natively (blocking on
    /// the pop, which wgpu-core answers at once); on the web, where nothing
    /// may block, errors go to the uncaptured-error handler instead.
    pub(crate) fn scoped_try<R>(
        &self,
        f: impl FnOnce() -> Result<R, GpuError>,
    ) -> Result<R, GpuError> {
        #[cfg(not(target_arch = "wasm32"))]
        {
            self.scoped_blocking(f)?
        }
        #[cfg(target_arch = "wasm32")]
        {
            f()
        }
    }

    /// [`scoped`](Self::scoped), blocking. Native only.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn scoped_blocking<R>(&self, f: impl FnOnce() -> R) -> Result<R, GpuError> {
        let _serial = self.serial();
        pollster::block_on(self.scoped(f))
    }
}

/// A one-shot channel whose receiving end can be awaited (no extra crate).
fn futures_channel() -> (OneShotTx, OneShotRx) {
    let cell = std::sync::Arc::new(std::sync::Mutex::new(OneShot::default()));
    (OneShotTx(cell.clone()), OneShotRx(cell))
}

#[derive(Default)]
struct OneShot {
    value: Option<Result<(), wgpu::BufferAsyncError>>,
    waker: Option<std::task::Waker>,
}

struct OneShotTx(std::sync::Arc<std::sync::Mutex<OneShot>>);
struct OneShotRx(std::sync::Arc<std::sync::Mutex<OneShot>>);

impl OneShotTx {
    fn send(self, v: Result<(), wgpu::BufferAsyncError>) {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        s.value = Some(v);
        if let Some(w) = s.waker.take() {
            w.wake();
        }
    }
}

impl OneShotRx {
    async fn recv(self) -> Result<(), wgpu::BufferAsyncError> {
        std::future::poll_fn(|cx| {
            let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
            match s.value.take() {
                Some(v) => std::task::Poll::Ready(v),
                None => {
                    s.waker = Some(cx.waker().clone());
                    std::task::Poll::Pending
                }
            }
        })
        .await
    }
}

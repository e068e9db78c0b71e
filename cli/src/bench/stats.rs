//! `pagedattn pipeline-stats`: what the Vulkan driver says about each
//! decode kernel's compiled pipeline (registers, spills, code size: the
//! statistics of `VK_KHR_pipeline_executable_properties`), built from the
//! same WGSL as wgpu builds it, once with wgpu's runtime checks (index
//! clamping, loop bounding) and once trusted. wgpu cannot ask its own
//! pipelines for these, so this opens its own Vulkan device with the
//! extension on the first adapter that has it, and compiles the SPIR-V naga
//! writes under the two policies. Native Linux/Windows only.

use ash::vk;
use naga::back::spv;
use pagedattn::gpu::shader::{source, Shader, ShaderShape};
use std::ffi::CStr;

/// One executable of one pipeline and its statistics.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StatRow {
    /// What was built: kernel, shape, checked or trusted.
    pub what: String,
    /// The executable's name (a shader stage, or a driver's internal part).
    pub executable: String,
    /// (statistic, value) as the driver names them.
    pub stats: Vec<(String, String)>,
}

/// The adapter the statistics came from and every row.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StatReport {
    /// The Vulkan device's name.
    pub device: String,
    /// Rows in order.
    pub rows: Vec<StatRow>,
}

/// SPIR-V of `kernel` at `shape`, as wgpu's Vulkan backend writes it with
/// its checks (`checked`: clamped indices, bounded loops) or trusted.
pub fn spirv(kernel: Shader, shape: &ShaderShape, checked: bool) -> Result<Vec<u32>, String> {
    let src = source(kernel, shape).ok_or_else(|| format!("no kernel {}", kernel.name()))?;
    let module = naga::front::wgsl::parse_str(&src).map_err(|e| e.emit_to_string(&src))?;
    let mut caps = naga::valid::Capabilities::SHADER_FLOAT16_IN_FLOAT32;
    if shape.subgroups {
        caps |= naga::valid::Capabilities::SUBGROUP;
    }
    let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps)
        .subgroup_stages(naga::valid::ShaderStages::COMPUTE)
        .subgroup_operations(naga::valid::SubgroupOperationSet::all())
        .validate(&module)
        .map_err(|e| e.emit_to_string(&src))?;
    let policy = if checked {
        naga::proc::BoundsCheckPolicy::Restrict
    } else {
        naga::proc::BoundsCheckPolicy::Unchecked
    };
    let opts = spv::Options {
        lang_version: (1, 3),
        flags: spv::WriterFlags::empty(),
        bounds_check_policies: naga::proc::BoundsCheckPolicies {
            index: policy,
            buffer: naga::proc::BoundsCheckPolicy::Unchecked,
            image_load: naga::proc::BoundsCheckPolicy::Unchecked,
            binding_array: naga::proc::BoundsCheckPolicy::Unchecked,
        },
        zero_initialize_workgroup_memory: spv::ZeroInitializeWorkgroupMemoryMode::Polyfill,
        force_loop_bounding: checked,
        ..Default::default()
    };
    let pipe = spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: "main".into(),
    };
    spv::write_vec(&module, &info, &opts, Some(&pipe)).map_err(|e| e.to_string())
}

/// The descriptor bindings of `kernel`'s set 0: (binding, uniform?).
fn bindings(kernel: Shader, shape: &ShaderShape) -> Result<Vec<(u32, bool)>, String> {
    let src = source(kernel, shape).ok_or_else(|| format!("no kernel {}", kernel.name()))?;
    let module = naga::front::wgsl::parse_str(&src).map_err(|e| e.emit_to_string(&src))?;
    Ok(module
        .global_variables
        .iter()
        .filter_map(|(_, g)| {
            let b = g.binding.as_ref()?;
            Some((b.binding, matches!(g.space, naga::AddressSpace::Uniform)))
        })
        .collect())
}

struct Vk {
    _entry: ash::Entry,
    instance: ash::Instance,
    device: ash::Device,
    exec: ash::khr::pipeline_executable_properties::Device,
    name: String,
}

impl Drop for Vk {
    fn drop(&mut self) {
        // SAFETY: every object made on the device was destroyed after use.
        unsafe {
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}

fn open() -> Result<Vk, String> {
    // SAFETY: plain Vulkan setup; every handle is checked and destroyed by
    // `Vk`'s drop.
    unsafe {
        let entry = ash::Entry::load().map_err(|e| format!("no Vulkan loader: {e}"))?;
        let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_1);
        let instance = entry
            .create_instance(
                &vk::InstanceCreateInfo::default().application_info(&app),
                None,
            )
            .map_err(|e| format!("vkCreateInstance: {e}"))?;
        let ext = ash::khr::pipeline_executable_properties::NAME;
        let mut chosen = None;
        let mut seen = Vec::new();
        for pd in instance.enumerate_physical_devices().unwrap_or_default() {
            let exts = instance
                .enumerate_device_extension_properties(pd)
                .unwrap_or_default();
            let props = instance.get_physical_device_properties(pd);
            seen.push(
                props
                    .device_name_as_c_str()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            );
            if !exts.iter().any(|e| e.extension_name_as_c_str() == Ok(ext)) {
                continue;
            }
            // A real GPU before a software one.
            let rank = match props.device_type {
                vk::PhysicalDeviceType::DISCRETE_GPU => 0,
                vk::PhysicalDeviceType::INTEGRATED_GPU => 1,
                _ => 2,
            };
            if chosen.as_ref().is_none_or(|(r, _, _)| rank < *r) {
                let name = props
                    .device_name_as_c_str()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                chosen = Some((rank, pd, name));
            }
        }
        let Some((_, pd, name)) = chosen else {
            instance.destroy_instance(None);
            return Err(format!(
                "no Vulkan device has VK_KHR_pipeline_executable_properties (devices: {})",
                if seen.is_empty() {
                    "none".into()
                } else {
                    seen.join(", ")
                }
            ));
        };
        let family = instance
            .get_physical_device_queue_family_properties(pd)
            .iter()
            .position(|q| q.queue_flags.contains(vk::QueueFlags::COMPUTE))
            .unwrap_or(0) as u32;
        let prio = [1.0f32];
        let queues = [vk::DeviceQueueCreateInfo::default()
            .queue_family_index(family)
            .queue_priorities(&prio)];
        let names = [ext.as_ptr()];
        let mut feat = vk::PhysicalDevicePipelineExecutablePropertiesFeaturesKHR::default()
            .pipeline_executable_info(true);
        let info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queues)
            .enabled_extension_names(&names)
            .push_next(&mut feat);
        let device = match instance.create_device(pd, &info, None) {
            Ok(d) => d,
            Err(e) => {
                instance.destroy_instance(None);
                return Err(format!("vkCreateDevice: {e}"));
            }
        };
        let exec = ash::khr::pipeline_executable_properties::Device::new(&instance, &device);
        Ok(Vk {
            _entry: entry,
            instance,
            device,
            exec,
            name,
        })
    }
}

fn text(chars: &[std::ffi::c_char]) -> String {
    // SAFETY: the driver writes NUL-terminated strings into fixed arrays.
    unsafe { CStr::from_ptr(chars.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// Builds `kernel` at `shape` (checked or trusted) on `vk` and reads its
/// executables' statistics.
fn one(
    vk: &Vk,
    kernel: Shader,
    shape: &ShaderShape,
    checked: bool,
) -> Result<Vec<StatRow>, String> {
    let words = spirv(kernel, shape, checked)?;
    let binds = bindings(kernel, shape)?;
    let what = format!(
        "{} {} {}",
        kernel.name(),
        shape_label(shape),
        if checked { "checked" } else { "trusted" }
    );
    // SAFETY: objects are created, queried and destroyed in order on one
    // device; the SPIR-V is naga's, validated above.
    unsafe {
        let d = &vk.device;
        let layout_bindings: Vec<vk::DescriptorSetLayoutBinding> = binds
            .iter()
            .map(|&(b, uniform)| {
                vk::DescriptorSetLayoutBinding::default()
                    .binding(b)
                    .descriptor_type(if uniform {
                        vk::DescriptorType::UNIFORM_BUFFER
                    } else {
                        vk::DescriptorType::STORAGE_BUFFER
                    })
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::COMPUTE)
            })
            .collect();
        let set = d
            .create_descriptor_set_layout(
                &vk::DescriptorSetLayoutCreateInfo::default().bindings(&layout_bindings),
                None,
            )
            .map_err(|e| format!("{what}: descriptor set layout: {e}"))?;
        let sets = [set];
        let layout = d
            .create_pipeline_layout(
                &vk::PipelineLayoutCreateInfo::default().set_layouts(&sets),
                None,
            )
            .map_err(|e| format!("{what}: pipeline layout: {e}"))?;
        let module = d
            .create_shader_module(&vk::ShaderModuleCreateInfo::default().code(&words), None)
            .map_err(|e| format!("{what}: shader module: {e}"))?;
        let stage = vk::PipelineShaderStageCreateInfo::default()
            .stage(vk::ShaderStageFlags::COMPUTE)
            .module(module)
            .name(c"main");
        let info = vk::ComputePipelineCreateInfo::default()
            .stage(stage)
            .layout(layout)
            .flags(vk::PipelineCreateFlags::CAPTURE_STATISTICS_KHR);
        let made = d.create_compute_pipelines(vk::PipelineCache::null(), &[info], None);
        let mut rows = Vec::new();
        let mut err = None;
        match made {
            Ok(p) => {
                let pipeline = p[0];
                let execs = vk
                    .exec
                    .get_pipeline_executable_properties(
                        &vk::PipelineInfoKHR::default().pipeline(pipeline),
                    )
                    .unwrap_or_default();
                for (i, e) in execs.iter().enumerate() {
                    let stats = vk
                        .exec
                        .get_pipeline_executable_statistics(
                            &vk::PipelineExecutableInfoKHR::default()
                                .pipeline(pipeline)
                                .executable_index(i as u32),
                        )
                        .unwrap_or_default();
                    rows.push(StatRow {
                        what: what.clone(),
                        executable: text(&e.name),
                        stats: stats
                            .iter()
                            .map(|s| {
                                let v = match s.format {
                                    vk::PipelineExecutableStatisticFormatKHR::BOOL32 => {
                                        (s.value.b32 != 0).to_string()
                                    }
                                    vk::PipelineExecutableStatisticFormatKHR::INT64 => {
                                        s.value.i64.to_string()
                                    }
                                    vk::PipelineExecutableStatisticFormatKHR::UINT64 => {
                                        s.value.u64.to_string()
                                    }
                                    vk::PipelineExecutableStatisticFormatKHR::FLOAT64 => {
                                        format!("{:.3}", s.value.f64)
                                    }
                                    _ => "?".into(),
                                };
                                (text(&s.name), v)
                            })
                            .collect(),
                    });
                }
                d.destroy_pipeline(pipeline, None);
            }
            Err((_, e)) => err = Some(format!("{what}: compute pipeline: {e}")),
        }
        d.destroy_shader_module(module, None);
        d.destroy_pipeline_layout(layout, None);
        d.destroy_descriptor_set_layout(set, None);
        match err {
            Some(e) => Err(e),
            None => Ok(rows),
        }
    }
}

fn shape_label(s: &ShaderShape) -> String {
    let mut l = format!(
        "{} d{} g{} ht{} lanes{}",
        s.dtype.name(),
        s.head_dim,
        s.group,
        s.head_tile(),
        s.lpt
    );
    if s.unroll > 0 {
        l += &format!(" u{} wg{}", s.unroll, s.workgroup);
    }
    if s.subgroups {
        l += " subgroups";
    }
    l
}

/// Statistics of `kernel` at each shape, checked and trusted, on the first
/// Vulkan device with the extension (a real GPU before a software one).
pub fn run(kernels: &[(Shader, ShaderShape)]) -> Result<StatReport, String> {
    let vk = open()?;
    let mut rows = Vec::new();
    for (kernel, shape) in kernels {
        for checked in [true, false] {
            rows.extend(one(&vk, *kernel, shape, checked)?);
        }
    }
    Ok(StatReport {
        device: vk.name.clone(),
        rows,
    })
}

/// The table: one line per executable, its statistics after it.
pub fn render(r: &StatReport) -> String {
    let mut out = format!(
        "pipeline statistics on {} (VK_KHR_pipeline_executable_properties)\n",
        r.device
    );
    for row in &r.rows {
        let stats: Vec<String> = row.stats.iter().map(|(k, v)| format!("{k}={v}")).collect();
        out += &format!("{} [{}]: {}\n", row.what, row.executable, stats.join(", "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagedattn::gpu::KvDtype;

    /// The SPIR-V the tool compiles is written under both policies for
    /// every decode kernel, and the checked one carries wgpu's checks (it
    /// is longer: loop counters and index clamps).
    #[test]
    fn checked_and_trusted_spirv_differ_by_the_checks() {
        for (kernel, shape) in [
            (
                Shader::AttentionLanes,
                ShaderShape {
                    lpt: 8,
                    subgroups: true,
                    ..ShaderShape::default()
                },
            ),
            (Shader::AttentionSerial, ShaderShape::default()),
            (Shader::Attention, ShaderShape::default()),
            (
                Shader::AttentionStream,
                ShaderShape {
                    dtype: KvDtype::F16,
                    group: 4,
                    lpt: 16,
                    unroll: 4,
                    workgroup: 128,
                    subgroups: true,
                    ..ShaderShape::default()
                },
            ),
        ] {
            let checked = spirv(kernel, &shape, true).unwrap();
            let trusted = spirv(kernel, &shape, false).unwrap();
            assert_eq!(checked[0], 0x0723_0203, "{kernel:?}: SPIR-V magic");
            assert!(
                checked.len() > trusted.len(),
                "{kernel:?}: {} vs {} words",
                checked.len(),
                trusted.len()
            );
            assert!(!bindings(kernel, &shape).unwrap().is_empty());
        }
    }
}

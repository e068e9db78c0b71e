//! The adapter's compute units (NVIDIA SMs, AMD CUs), which wgpu does not
//! report: read through wgpu's Vulkan backend from
//! `VK_NV_shader_sm_builtins` or `VK_AMD_shader_core_properties` where the
//! driver has them, else from a table of known adapters. `Split::Auto`
//! sizes its partitions from them (`kernels::auto_partition`).

/// Where a compute-unit count came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum UnitsSource {
    /// `VkPhysicalDeviceShaderSMBuiltinsPropertiesNV::shaderSMCount`.
    VulkanNvSmBuiltins,
    /// `VkPhysicalDeviceShaderCorePropertiesAMD`: shader engines x arrays
    /// per engine x compute units per array.
    VulkanAmdShaderCore,
    /// [`KNOWN_ADAPTERS`], by adapter name.
    Table,
}

/// An adapter's compute units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ComputeUnits {
    /// SMs (NVIDIA), CUs (AMD).
    pub count: u32,
    /// Where the count came from.
    pub source: UnitsSource,
}

/// Adapters whose compute units are known by name, for drivers that do not
/// report them (lower-case substrings of the adapter name, most specific
/// first; the vendors' published SM counts).
pub const KNOWN_ADAPTERS: &[(&str, u32)] = &[
    ("h200", 132),
    ("h100 pcie", 114),
    ("h100", 132),
    ("a100", 108),
    ("l40s", 142),
    ("rtx 4090", 128),
    ("rtx 3090", 82),
];

/// The compute units of the device behind `device` (opened on `info`'s
/// adapter), if the driver or the table knows them.
pub(crate) fn query(device: &wgpu::Device, info: &wgpu::AdapterInfo) -> Option<ComputeUnits> {
    from_driver(device, info).or_else(|| from_table(&info.name))
}

/// The table's count for an adapter called `name`.
pub fn from_table(name: &str) -> Option<ComputeUnits> {
    let name = name.to_ascii_lowercase();
    KNOWN_ADAPTERS
        .iter()
        .find(|(n, _)| name.contains(n))
        .map(|&(_, count)| ComputeUnits {
            count,
            source: UnitsSource::Table,
        })
}

#[cfg(all(
    not(target_arch = "wasm32"),
    any(target_os = "linux", target_os = "windows", target_os = "android")
))]
fn from_driver(device: &wgpu::Device, info: &wgpu::AdapterInfo) -> Option<ComputeUnits> {
    use ash::vk;
    if info.backend != wgpu::Backend::Vulkan {
        return None;
    }
    // SAFETY: the hal device is only read (its instance and physical
    // device handles, for two property queries); nothing is created or
    // destroyed, and the guard is dropped before returning.
    unsafe {
        let hal = device.as_hal::<wgpu::hal::api::Vulkan>()?;
        let instance = hal.shared_instance().raw_instance();
        let pd = hal.raw_physical_device();
        let exts = instance.enumerate_device_extension_properties(pd).ok()?;
        let has = |name: &std::ffi::CStr| {
            exts.iter()
                .any(|e| e.extension_name_as_c_str().is_ok_and(|n| n == name))
        };
        if has(vk::NV_SHADER_SM_BUILTINS_NAME) {
            let mut sm = vk::PhysicalDeviceShaderSMBuiltinsPropertiesNV::default();
            let mut props = vk::PhysicalDeviceProperties2::default().push_next(&mut sm);
            instance.get_physical_device_properties2(pd, &mut props);
            if sm.shader_sm_count > 0 {
                return Some(ComputeUnits {
                    count: sm.shader_sm_count,
                    source: UnitsSource::VulkanNvSmBuiltins,
                });
            }
        }
        if has(vk::AMD_SHADER_CORE_PROPERTIES_NAME) {
            let mut core = vk::PhysicalDeviceShaderCorePropertiesAMD::default();
            let mut props = vk::PhysicalDeviceProperties2::default().push_next(&mut core);
            instance.get_physical_device_properties2(pd, &mut props);
            let count = core
                .shader_engine_count
                .saturating_mul(core.shader_arrays_per_engine_count)
                .saturating_mul(core.compute_units_per_shader_array);
            if count > 0 {
                return Some(ComputeUnits {
                    count,
                    source: UnitsSource::VulkanAmdShaderCore,
                });
            }
        }
    }
    None
}

#[cfg(not(all(
    not(target_arch = "wasm32"),
    any(target_os = "linux", target_os = "windows", target_os = "android")
)))]
fn from_driver(_device: &wgpu::Device, _info: &wgpu::AdapterInfo) -> Option<ComputeUnits> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The most specific name wins; unknown adapters have no count.
    #[test]
    fn the_table_knows_adapters_by_name() {
        let n = |s: &str| from_table(s).map(|u| u.count);
        assert_eq!(n("NVIDIA H200"), Some(132));
        assert_eq!(n("NVIDIA H100 PCIe"), Some(114));
        assert_eq!(n("NVIDIA H100 80GB HBM3"), Some(132));
        assert_eq!(n("llvmpipe (LLVM 19.1.7, 256 bits)"), None);
    }
}

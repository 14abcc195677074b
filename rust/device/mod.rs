//! Devices: where a model's weights, K/V and compute live.
//!
//! The CPU backend runs the forward pass on the host. The CUDA backend (feature "cuda", `cuda/`)
//! has the probe (it finds the driver and the GPUs without ever panicking when there is none),
//! the kernels as `.cu` sources compiled by NVRTC at load with an on-disk cache, cuBLAS products,
//! the GPU's K/V part, and the forward pass with captured decode graphs (`cuda/runner/`).
//! `graphs` is the CUDA-graph cache's device-independent logic. `memory_pool` accounts what each
//! device's memory holds, by purpose.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod graphs;
pub mod memory_pool;
pub mod split;

use crate::error::{Result, StrataError};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Device {
    /// The host, as one device (`cpu`).
    Cpu,
    /// The host, as several devices holding consecutive layer ranges (`cpu:0,1`), each with its
    /// own memory pool: the layer split's machinery, run and tested without a GPU.
    CpuList(Vec<usize>),
    /// One GPU, or several holding consecutive layer ranges (`cuda:0,1`).
    Cuda(Vec<usize>),
}

/// What the probe knows about one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDeviceInfo {
    pub index: usize,
    pub name: String,
    pub total_memory: usize,
}

impl Device {
    /// Parses "cpu", "cpu:N,M,...", "cuda", "cuda:N" or "cuda:N,M,...".
    pub fn parse(spec: &str) -> Result<Device> {
        let bad = |why: &str| StrataError::invalid("device", format!("{spec:?}: {why}"));
        let s = spec.trim();
        if s == "cpu" {
            return Ok(Device::Cpu);
        }
        if s == "cuda" {
            return Ok(Device::Cuda(vec![0]));
        }
        let (list, make): (&str, fn(Vec<usize>) -> Device) =
            if let Some(list) = s.strip_prefix("cuda:") {
                (list, Device::Cuda)
            } else if let Some(list) = s.strip_prefix("cpu:") {
                (list, Device::CpuList)
            } else {
                return Err(bad(
                    "expected \"cpu\", \"cpu:N,M\", \"cuda\", \"cuda:N\" or \"cuda:N,M\"",
                ));
            };
        let mut ids = Vec::new();
        for part in list.split(',') {
            let id: usize = part
                .trim()
                .parse()
                .map_err(|_| bad("device indices must be non-negative integers"))?;
            if ids.contains(&id) {
                return Err(bad("a device index appears twice"));
            }
            ids.push(id);
        }
        Ok(make(ids))
    }

    /// The whole spec, normalized: "cpu", "cpu:0,1", "cuda:0".
    pub fn name(&self) -> String {
        match self {
            Device::Cpu => "cpu".into(),
            Device::CpuList(ids) => format!("cpu:{}", join(ids)),
            Device::Cuda(ids) => format!("cuda:{}", join(ids)),
        }
    }

    /// One name per device of the list, in layer order: "cpu" for plain `cpu`, else "cpu:0",
    /// "cpu:1", "cuda:0", ... (the `device` label of the memory metrics).
    pub fn members(&self) -> Vec<String> {
        match self {
            Device::Cpu => vec!["cpu".into()],
            Device::CpuList(ids) => ids.iter().map(|i| format!("cpu:{i}")).collect(),
            Device::Cuda(ids) => ids.iter().map(|i| format!("cuda:{i}")).collect(),
        }
    }
}

fn join(ids: &[usize]) -> String {
    let ids: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    ids.join(",")
}

/// The GPUs this process can use; empty when there is no driver (or no "cuda" feature).
pub fn cuda_devices() -> Vec<CudaDeviceInfo> {
    #[cfg(feature = "cuda")]
    {
        cuda::probe().unwrap_or_default()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Vec::new()
    }
}

/// Checks that `device` can be used by this build on this machine.
pub fn check_available(device: &Device) -> Result<()> {
    let Device::Cuda(ids) = device else {
        return Ok(());
    };
    let name = device.name();
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ids;
        Err(StrataError::DeviceUnavailable(format!(
            "device {name}: this build of strata-rs has no CUDA support (built without the \"cuda\" feature)"
        )))
    }
    #[cfg(feature = "cuda")]
    {
        let found = cuda::probe().map_err(|why| {
            StrataError::DeviceUnavailable(format!("device {name}: no usable CUDA driver: {why}"))
        })?;
        if let Some(missing) = ids.iter().find(|i| !found.iter().any(|d| d.index == **i)) {
            return Err(StrataError::DeviceUnavailable(format!(
                "device {name}: GPU {missing} does not exist ({} GPU(s) visible)",
                found.len()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_specs() {
        assert_eq!(Device::parse("cpu").unwrap(), Device::Cpu);
        assert_eq!(Device::parse("cuda").unwrap(), Device::Cuda(vec![0]));
        assert_eq!(Device::parse("cuda:0,1").unwrap(), Device::Cuda(vec![0, 1]));
        assert_eq!(
            Device::parse("cpu:0,1").unwrap(),
            Device::CpuList(vec![0, 1])
        );
        assert_eq!(Device::parse(" cpu:1, 0 ").unwrap().name(), "cpu:1,0");
        assert_eq!(
            Device::parse("cpu:0,1").unwrap().members(),
            ["cpu:0", "cpu:1"]
        );
        assert_eq!(Device::parse("cpu").unwrap().members(), ["cpu"]);
        assert_eq!(
            Device::parse("cuda:2,3").unwrap().members(),
            ["cuda:2", "cuda:3"]
        );
        assert_eq!(
            Device::parse("tpu").unwrap_err().to_string(),
            "device: \"tpu\": expected \"cpu\", \"cpu:N,M\", \"cuda\", \"cuda:N\" or \"cuda:N,M\""
        );
        assert_eq!(
            Device::parse("cpu:0,x").unwrap_err().to_string(),
            "device: \"cpu:0,x\": device indices must be non-negative integers"
        );
        assert_eq!(
            Device::parse("cpu:1,1").unwrap_err().to_string(),
            "device: \"cpu:1,1\": a device index appears twice"
        );
        assert_eq!(
            Device::parse("cuda:0,0").unwrap_err().to_string(),
            "device: \"cuda:0,0\": a device index appears twice"
        );
        assert!(Device::parse("cuda:-1").is_err());
    }

    #[test]
    fn no_driver_means_no_devices_and_a_clear_error() {
        // This test machine has no GPU driver; where one exists the list is simply non-empty.
        if !cuda_devices().is_empty() {
            return;
        }
        let e = check_available(&Device::Cuda(vec![0])).unwrap_err();
        assert!(matches!(e, StrataError::DeviceUnavailable(_)), "{e:?}");
        assert!(e.to_string().starts_with("device cuda:0: "), "{e}");
    }
}

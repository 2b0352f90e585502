//! GPU slots: real devices found with cudarc where a driver exists, otherwise
//! `--virtual-gpus N` slots that run on the CPU (development, tests, CI).

/// One GPU as the host sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpu {
    /// Device ordinal.
    pub index: u32,
    /// Device name.
    pub name: String,
    /// Total memory in bytes.
    pub memory_bytes: u64,
}

/// The GPUs of this machine; empty when there is no CUDA driver or no device.
pub fn discover() -> Vec<Gpu> {
    use cudarc::driver::{result, sys};
    // Without the driver library, cudarc panics on first use: ask first.
    // SAFETY: only checks whether the shared library can be loaded.
    if !unsafe { sys::is_culib_present() } {
        return Vec::new();
    }
    if result::init().is_err() {
        return Vec::new();
    }
    let count = result::device::get_count().unwrap_or(0).max(0) as u32;
    (0..count)
        .filter_map(|i| {
            let dev = result::device::get(i as i32).ok()?;
            let name = result::device::get_name(dev).unwrap_or_else(|_| "unknown GPU".into());
            // SAFETY: `dev` came from `device::get`.
            let memory_bytes = unsafe { result::device::total_mem(dev) }.unwrap_or(0) as u64;
            Some(Gpu { index: i, name, memory_bytes })
        })
        .collect()
}

/// The slots a host runs: `virtual_gpus` CPU-backed ones when given, else the
/// real GPUs. Returns (slots, whether they are real).
pub fn slots(virtual_gpus: Option<u32>) -> (Vec<Gpu>, bool) {
    match virtual_gpus {
        Some(n) => ((0..n).map(|index| Gpu { index, name: "virtual".into(), memory_bytes: 0 }).collect(), false),
        None => (discover(), true),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn virtual_slots_are_numbered_and_not_real() {
        let (slots, real) = super::slots(Some(3));
        assert!(!real);
        assert_eq!(slots.iter().map(|g| g.index).collect::<Vec<_>>(), vec![0, 1, 2]);
    }

    #[test]
    fn discovery_without_a_driver_finds_nothing_and_does_not_panic() {
        // On machines with a driver this lists real devices; either way no panic.
        let gpus = super::discover();
        assert!(gpus.iter().all(|g| !g.name.is_empty()));
    }
}

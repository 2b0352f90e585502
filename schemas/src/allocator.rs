//! How LooseLeaf's processes keep freed memory for their next large buffer (ADR 69).
//!
//! A cell's output of a megabyte crosses every process on its way (worker, host,
//! frontend, kernel) as a few transient buffers of that size. glibc serves an
//! allocation over 128 KiB with an mmap of its own and trims the heap's free top
//! above 128 KiB, so each such buffer is faulted in page by page again on every
//! cell: about 1 ms per megabyte on the machines we measured, several times the
//! copy itself. Buffers up to [`MMAP_THRESHOLD`] come from the heap instead, and up
//! to [`TRIM_THRESHOLD`] of its free top is kept. The worker sets the same in its
//! zygote (`looseleaf_worker/zygote.py`).

/// Allocations up to this many bytes come from the heap, not an mmap of their own.
pub const MMAP_THRESHOLD: i32 = 16 << 20;

/// Free memory at the heap's top up to this many bytes is kept, not given back.
pub const TRIM_THRESHOLD: i32 = 64 << 20;

/// Set the process's allocator to keep freed memory as above; call it first thing
/// in `main`. Nothing where the C library is not glibc.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    glibc::set(MMAP_THRESHOLD, TRIM_THRESHOLD);
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod glibc {
    use std::os::raw::c_int;

    extern "C" {
        fn mallopt(param: c_int, value: c_int) -> c_int;
    }

    // glibc's malloc.h
    const M_TRIM_THRESHOLD: c_int = -1;
    const M_MMAP_THRESHOLD: c_int = -3;

    pub(super) fn set(mmap_threshold: c_int, trim_threshold: c_int) {
        // SAFETY: mallopt only sets two of glibc's malloc parameters; it returns 0
        // on a value out of range, which leaves glibc's default (nothing to do).
        unsafe {
            mallopt(M_MMAP_THRESHOLD, mmap_threshold);
            mallopt(M_TRIM_THRESHOLD, trim_threshold);
        }
    }
}

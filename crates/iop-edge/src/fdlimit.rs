//! The process's open-files limit: every client connection and every node connection is a
//! file descriptor, and the common default soft limit (1024) is far below what an edge
//! facing the internet needs. At start the edge raises its soft limit to the hard limit.

use nix::sys::resource::{RLIM_INFINITY, Resource, getrlimit, setrlimit};

/// What to ask for when the hard limit is "unlimited" (the kernel refuses that for files).
const UNLIMITED_TARGET: u64 = 1 << 20;

/// Raises the soft open-files limit to the hard limit; returns the soft limit in force
/// afterwards.
pub fn raise_open_files_limit() -> std::io::Result<u64> {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    let target = if hard == RLIM_INFINITY {
        UNLIMITED_TARGET
    } else {
        hard
    };
    if soft != RLIM_INFINITY && soft < target {
        setrlimit(Resource::RLIMIT_NOFILE, target, hard)?;
    }
    Ok(open_files_limit().unwrap_or(soft))
}

/// The soft open-files limit now (`None` if it cannot be read or is unlimited).
pub fn open_files_limit() -> Option<u64> {
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, _)) if soft != RLIM_INFINITY => Some(soft),
        _ => None,
    }
}

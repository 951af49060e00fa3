//! The edge's state directory on disk: created `0700`, every file in it written `0600`
//! through a temporary file and a rename (`iop_proto::private_file`, as the node writes
//! its credential), so a crash never leaves half a key or half a token list behind.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;

/// Creates `dir` (mode 0700) if it does not exist; an existing directory is tightened to
/// 0700 when others could read it.
pub fn ensure_private_dir(dir: &Path) -> io::Result<()> {
    match fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => {
            if meta.permissions().mode() & 0o077 != 0 {
                tracing::warn!(dir = %dir.display(), "state directory was readable by others: setting it to 0700");
                fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
            }
            Ok(())
        }
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a directory", dir.display()),
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir),
        Err(e) => Err(e),
    }
}

/// Whether `dir` is missing or holds no entries (a first start).
pub fn is_empty_dir(dir: &Path) -> io::Result<bool> {
    match fs::read_dir(dir) {
        Ok(mut entries) => Ok(entries.next().is_none()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(true),
        Err(e) => Err(e),
    }
}

/// Reads a state file; `Ok(None)` when it does not exist.
pub fn read_optional(path: &Path) -> io::Result<Option<Vec<u8>>> {
    match fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_private_and_replaced_whole() {
        use iop_proto::private_file::write_private;
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        ensure_private_dir(&state).unwrap();
        assert_eq!(
            fs::metadata(&state).unwrap().permissions().mode() & 0o777,
            0o700
        );
        assert!(is_empty_dir(&state).unwrap());
        let file = state.join("key");
        write_private(&file, b"one").unwrap();
        write_private(&file, b"two").unwrap();
        assert_eq!(fs::read(&file).unwrap(), b"two");
        assert_eq!(
            fs::metadata(&file).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert!(!is_empty_dir(&state).unwrap());
        assert_eq!(
            fs::read_dir(&state).unwrap().count(),
            1,
            "no temporary file left"
        );
    }
}

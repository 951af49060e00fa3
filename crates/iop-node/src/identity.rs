//! The node's state file: the credential it received when it joined an edge (a client
//! certificate and its private key, which never left this machine), the edge's addresses
//! and the pins it trusts the edge by. Written 0600, atomically; read at every start so a
//! joined node needs nothing but the file.

use std::fs;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Default state file name, in the working directory.
pub const DEFAULT_STATE_FILE: &str = "iop-node-state.json";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeState {
    /// The node id the edge issued the credential for.
    pub node_id: String,
    /// The edge's node listener addresses (`host:port`), in order.
    pub edges: Vec<String>,
    /// Pins (`sha256:...`) the edge is trusted by; any one must match.
    pub pins: Vec<String>,
    /// The id of the join token the credential came from (a join string with another id
    /// is a new join).
    pub join_token_id: String,
    /// The node's client certificate (PEM) and private key (PEM, PKCS#8).
    pub certificate_pem: String,
    pub key_pem: String,
    pub expires_unix_ms: u64,
}

impl NodeState {
    /// Reads the state file; `Ok(None)` when there is none.
    pub fn load(path: &Path) -> Result<Option<NodeState>, String> {
        let bytes = match fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(format!(
                    "cannot read the node state file {}: {e}",
                    path.display()
                ));
            }
        };
        serde_json::from_slice(&bytes).map(Some).map_err(|e| {
            format!(
                "{} is not a node state file ({e}): move it away and join again with a new join string",
                path.display()
            )
        })
    }

    /// Writes the state file with mode 0600, atomically.
    pub fn save(&self, path: &Path) -> Result<(), String> {
        let mut bytes = serde_json::to_vec_pretty(self).expect("serializable");
        bytes.push(b'\n');
        write_private(path, &bytes)
            .map_err(|e| format!("cannot write the node state file {}: {e}", path.display()))
    }
}

/// Checks that a state file can be written at `path` (before a join token is spent).
pub fn check_writable(path: &Path) -> Result<(), String> {
    let probe = path.with_file_name(format!(
        ".{}.probe-{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("state"),
        std::process::id()
    ));
    let result = prepare_dir(path).and_then(|()| {
        fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&probe)
            .map(drop)
    });
    let _ = fs::remove_file(&probe);
    result.map_err(|e| {
        format!(
            "cannot write the node state file {} ({e}): the node keeps its credential there; choose another with --state-file",
            path.display()
        )
    })
}

fn prepare_dir(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() && !dir.exists() => fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir),
        _ => Ok(()),
    }
}

fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    prepare_dir(path)?;
    iop_proto::private_file::write_private(path, bytes)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn the_state_file_round_trips_with_mode_0600() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("state.json");
        assert_eq!(NodeState::load(&path).unwrap(), None);
        check_writable(&path).unwrap();
        let state = NodeState {
            node_id: "gpu".into(),
            edges: vec!["edge:7700".into()],
            pins: vec!["sha256:x".into()],
            join_token_id: "abc".into(),
            certificate_pem: "cert".into(),
            key_pem: "key".into(),
            expires_unix_ms: 1,
        };
        state.save(&path).unwrap();
        assert_eq!(NodeState::load(&path).unwrap(), Some(state));
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(fs::read_dir(path.parent().unwrap()).unwrap().count(), 1);
    }
}

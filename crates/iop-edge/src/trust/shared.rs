//! The fleet's CA as this edge takes it: the store's (its key sealed with the operator's
//! secret key), mirrored into the state directory; the first edge to reach an empty store
//! gives the fleet its own. The join tokens and revocations the edges share are the
//! store's statements ([`crate::store::trust`]).

use std::path::Path;

use super::ca::{CA_CERT, CA_KEY, EdgeCa};
use crate::store::Store;
use crate::store::seal::Sealer;
use crate::store::trust::{self, SealedCa};

/// What the sealed CA key is bound to.
const CA_KEY_LABEL: &str = "iop fleet CA private key";

/// The fleet's CA, mirrored into `dir`. The first edge to reach an empty store gives the
/// fleet its CA: the one in `dir` when it has one (its nodes keep their pin), else a new
/// one. Every other edge takes the store's; a different CA of its own is kept beside it
/// as `ca.pem.before-fleet` / `ca.key.before-fleet` and its nodes must join again.
pub async fn fleet_ca(store: &Store, sealer: &Sealer, dir: &Path) -> Result<EdgeCa, String> {
    let local = local_ca(dir)?;
    let local_pin = local.as_ref().map(EdgeCa::pin);
    let fleet = match trust::ca(store).await? {
        Some(fleet) => fleet,
        None => {
            let offered = match local {
                Some(ca) => ca,
                None => EdgeCa::generate().map_err(|e| e.to_string())?,
            };
            let (cert_pem, key_pem) = offered.to_pem();
            let sealed = SealedCa {
                cert_pem,
                key_sealed: sealer.seal(CA_KEY_LABEL, key_pem.as_bytes()),
                key_check: sealer.check().to_string(),
            };
            trust::offer_ca(store, &sealed).await?
        }
    };
    if fleet.key_check != sealer.check() {
        return Err(
            "the store's CA was sealed with another secret key: give this edge the same \
             store secret key as the others"
                .into(),
        );
    }
    let key_pem = String::from_utf8(sealer.open(CA_KEY_LABEL, &fleet.key_sealed)?)
        .map_err(|_| "the store's CA key is not PEM text".to_string())?;
    let ca =
        EdgeCa::from_pem(&fleet.cert_pem, &key_pem).map_err(|e| format!("the store's CA: {e}"))?;
    match local_pin {
        Some(own) if own == ca.pin() => {}
        Some(own) => {
            for file in [CA_CERT, CA_KEY] {
                let from = dir.join(file);
                let _ = std::fs::rename(&from, dir.join(format!("{file}.before-fleet")));
            }
            tracing::warn!(
                own_pin = %own,
                fleet_pin = %ca.pin(),
                state_dir = %dir.display(),
                "this edge's own CA is replaced by the fleet's (kept as ca.*.before-fleet): nodes that pinned it must join again"
            );
            ca.save(dir).map_err(|e| e.to_string())?;
        }
        None => ca.save(dir).map_err(|e| e.to_string())?,
    }
    Ok(ca)
}

/// The CA in `dir`, if it holds one.
fn local_ca(dir: &Path) -> Result<Option<EdgeCa>, String> {
    if !dir.join(CA_CERT).exists() && !dir.join(CA_KEY).exists() {
        return Ok(None);
    }
    EdgeCa::load_or_create(dir)
        .map(|(ca, _)| Some(ca))
        .map_err(|e| e.to_string())
}

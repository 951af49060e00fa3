//! Model-group admission as the surfaces use it: a slot on a live member and that member's
//! current session, or a clear reason why not.

use std::sync::Arc;

use super::Edge;
use super::admission::{AdmitError, Admitted};
use super::run::SubmitError;
use crate::lease::Lane;
use crate::session::NodeSession;

/// Attempts at a grant whose node changed generation between grant and send.
const STALE_GRANT_RETRIES: usize = 3;

impl Edge {
    /// Waits for a slot of `lane` in `group` and returns it with the member's session.
    pub async fn admit_group(
        self: &Arc<Self>,
        group: &str,
        lane: Lane,
    ) -> Result<(Admitted, Arc<NodeSession>), SubmitError> {
        for _ in 0..STALE_GRANT_RETRIES {
            let admitted = self.admission.acquire(group, lane).await?;
            self.metrics.observe_queue_wait(group, admitted.waited);
            match self.session(&admitted.grant.node) {
                Some(session) if session.generation == admitted.grant.generation => {
                    return Ok((admitted, session));
                }
                // The node's connection changed under the grant: its lease was fenced
                // already, so dropping it is a no-op. Try again.
                _ => drop(admitted),
            }
        }
        Err(AdmitError::Unavailable {
            group: group.to_string(),
            reason: "its nodes keep reconnecting".into(),
        }
        .into())
    }
}

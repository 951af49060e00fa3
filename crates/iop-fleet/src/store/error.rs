//! What can go wrong with the fleet's store, by what the caller does about it: no
//! connection (wait and try again), a statement that failed, or something the store holds
//! that this edge cannot use (a newer schema, a refusal it does not know). The text never
//! holds the store's URL or password.

/// The store did not do what was asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// No connection: the store is unreachable, refused this edge, or none was free in time.
    #[error("{0}")]
    Unavailable(String),
    /// A statement failed (`what` names it).
    #[error("store ({what}): {reason}")]
    Statement { what: String, reason: String },
    /// The store holds or answered what this edge cannot use.
    #[error("{0}")]
    Unusable(String),
}

impl StoreError {
    /// `what` failed with `e`, as PostgreSQL or the connection said it.
    pub fn statement(what: impl Into<String>, e: &tokio_postgres::Error) -> Self {
        Self::Statement {
            what: what.into(),
            reason: reason(e),
        }
    }
}

/// For the callers that report the store's errors among others as text.
impl From<StoreError> for String {
    fn from(e: StoreError) -> Self {
        e.to_string()
    }
}

/// What went wrong, as PostgreSQL or the connection said it (never the URL).
pub fn reason(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return format!("{} ({})", db.message(), db.code().code());
    }
    // The causes too: "error performing TLS handshake" alone does not say which.
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(inner) = cause {
        let said = inner.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        cause = inner.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_says_what_failed() {
        let e = StoreError::Statement {
            what: "read CA".into(),
            reason: "relation does not exist (42P01)".into(),
        };
        assert_eq!(
            e.to_string(),
            "store (read CA): relation does not exist (42P01)"
        );
        assert_eq!(
            String::from(StoreError::Unavailable("no connection".into())),
            "no connection"
        );
    }
}

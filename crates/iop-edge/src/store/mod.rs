//! The shared store: the PostgreSQL database the edges of a fleet share (`store.url`).
//! [`Store::open`] connects and brings the schema up to date ([`migrations`]); the
//! connection is driven by its own task and opened again when it breaks. Today the store
//! holds the fleet's live edges ([`edges`]); the rest of what edges share comes next.

pub mod edges;
pub mod migrations;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;

/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection to the store, opened again on demand after it broke.
pub struct Store {
    config: tokio_postgres::Config,
    client: Mutex<Option<Arc<tokio_postgres::Client>>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the URL: it may hold a password.
        f.debug_struct("Store").finish_non_exhaustive()
    }
}

impl Store {
    /// Connects and migrates; the error says what failed, never the URL.
    pub async fn open(config: tokio_postgres::Config) -> Result<Arc<Store>, String> {
        let store = Arc::new(Store {
            config,
            client: Mutex::new(None),
        });
        let client = store.client().await?;
        migrations::apply(&client).await?;
        Ok(store)
    }

    /// The live connection, or a new one.
    pub async fn client(&self) -> Result<Arc<tokio_postgres::Client>, String> {
        let mut slot = self.client.lock().await;
        if let Some(client) = slot.as_ref().filter(|c| !c.is_closed()) {
            return Ok(client.clone());
        }
        let connect = self.config.connect(tokio_postgres::NoTls);
        let (client, connection) = tokio::time::timeout(CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| format!("no connection to the store within {CONNECT_TIMEOUT:?}"))?
            .map_err(|e| format!("cannot connect to the store: {}", reason(&e)))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::warn!(error = %reason(&e), "the connection to the store broke");
            }
        });
        let client = Arc::new(client);
        *slot = Some(client.clone());
        Ok(client)
    }
}

/// What went wrong, as PostgreSQL or the connection said it (never the URL).
pub fn reason(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => e.to_string(),
    }
}

//! The shared store: the PostgreSQL database the edges of a fleet share (`store.url`).
//! [`Store::open`] connects and brings the schema up to date ([`migrations`]); the
//! connection is driven by its own task and opened again when it breaks. The store holds
//! the fleet's live edges ([`edges`]) and its node trust (`crate::trust::shared`: the CA,
//! its key sealed by [`seal`], join tokens, revocations).

pub mod edges;
pub mod migrations;
pub mod seal;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::{Mutex, mpsc};
use tokio_util::sync::CancellationToken;

/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection to the store, opened again on demand after it broke; the schema is
/// brought up to date on the first connection.
pub struct Store {
    config: tokio_postgres::Config,
    client: Mutex<Option<Arc<tokio_postgres::Client>>>,
    migrated: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the URL: it may hold a password.
        f.debug_struct("Store").finish_non_exhaustive()
    }
}

impl Store {
    /// A store not connected yet: the first [`Store::client`] connects and migrates.
    pub fn new(config: tokio_postgres::Config) -> Arc<Store> {
        Arc::new(Store {
            config,
            client: Mutex::new(None),
            migrated: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Connects and migrates; the error says what failed, never the URL.
    pub async fn open(config: tokio_postgres::Config) -> Result<Arc<Store>, String> {
        let store = Store::new(config);
        store.client().await?;
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
        if !self.migrated.load(std::sync::atomic::Ordering::Acquire) {
            migrations::apply(&client).await?;
            self.migrated
                .store(true, std::sync::atomic::Ordering::Release);
            tracing::info!("store connected and its schema up to date");
        }
        let client = Arc::new(client);
        *slot = Some(client.clone());
        Ok(client)
    }
}

impl Store {
    /// Listens on `channel` on a connection of its own (opened again when it breaks)
    /// until `shutdown`; the receiver gets a wake-up for each notification (coalesced).
    pub fn listen(&self, channel: &'static str, shutdown: CancellationToken) -> mpsc::Receiver<()> {
        let (wake, woken) = mpsc::channel(1);
        let config = self.config.clone();
        tokio::spawn(async move {
            loop {
                let connect =
                    tokio::time::timeout(CONNECT_TIMEOUT, config.connect(tokio_postgres::NoTls));
                if let Ok(Ok((client, mut connection))) = connect.await {
                    let (notified, mut notifications) = mpsc::unbounded_channel();
                    let drive = tokio::spawn(async move {
                        let mut messages =
                            futures::stream::poll_fn(move |cx| connection.poll_message(cx));
                        while let Some(Ok(message)) = messages.next().await {
                            if matches!(message, tokio_postgres::AsyncMessage::Notification(_)) {
                                let _ = notified.send(());
                            }
                        }
                    });
                    if client
                        .batch_execute(&format!("LISTEN {channel}"))
                        .await
                        .is_ok()
                    {
                        loop {
                            tokio::select! {
                                _ = shutdown.cancelled() => {
                                    drive.abort();
                                    return;
                                }
                                n = notifications.recv() => match n {
                                    Some(()) => { let _ = wake.try_send(()); }
                                    None => break,
                                },
                            }
                        }
                    }
                    drive.abort();
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(CONNECT_TIMEOUT) => {}
                }
            }
        });
        woken
    }
}

/// What went wrong, as PostgreSQL or the connection said it (never the URL).
pub fn reason(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => e.to_string(),
    }
}

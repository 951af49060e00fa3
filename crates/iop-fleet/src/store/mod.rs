//! The shared store: the PostgreSQL database the edges of a fleet share (`store.url`).
//! [`Store::client`] hands out a connection of a small pool (`deadpool-postgres`; a broken
//! one is replaced) and, on the first one, brings the schema up to date ([`migrations`]).
//! A slow batch (the ledger shipping) therefore never holds up an admission behind it on
//! one connection, and connecting after an outage happens once per connection, not under
//! one lock every caller waits on. The store holds
//! the fleet's live edges ([`edges`]), its node trust ([`trust`]: the CA, its key sealed
//! by [`seal`], join tokens, revocations), the API key limits every edge counts in
//! ([`key_limits`]) and the usage records every edge ships ([`usage`]).

pub mod edges;
pub mod error;
pub mod key_limits;
pub mod migrations;
pub mod seal;
pub mod tls;
pub mod trust;
pub mod usage;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;

pub use error::{StoreError, reason};
use tokio::sync::{Mutex, mpsc};
use tokio_util::sync::CancellationToken;

/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Connections each edge keeps to the store for its requests and background work (the
/// listeners for revocations and the fleet's edges have their own).
pub const POOL_SIZE: usize = 4;

/// A pooled connection to the store.
pub type Client = deadpool_postgres::Object;

/// The store's connections, opened on demand and again after they broke; the schema is
/// brought up to date on the first connection.
pub struct Store {
    config: tokio_postgres::Config,
    /// TLS to the store ([`tls`]), when the URL asks for it or the host is another machine.
    tls: Option<tls::MakeRustls>,
    pool: deadpool_postgres::Pool,
    migrated: std::sync::atomic::AtomicBool,
    /// Held by the one caller bringing the schema up to date.
    migrating: Mutex<()>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the URL: it may hold a password.
        f.debug_struct("Store").finish_non_exhaustive()
    }
}

impl Store {
    /// A store not connected yet: the first [`Store::client`] connects and migrates.
    pub fn new(config: tokio_postgres::Config, tls: Option<tls::MakeRustls>) -> Arc<Store> {
        use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
        // A closed connection is never handed out again; one that broke unnoticed fails
        // its query, and the caller's fallback covers it.
        let recycling = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        let manager = match &tls {
            Some(tls) => Manager::from_config(config.clone(), tls.clone(), recycling),
            None => Manager::from_config(config.clone(), tokio_postgres::NoTls, recycling),
        };
        let pool = Pool::builder(manager)
            .max_size(POOL_SIZE)
            .runtime(Runtime::Tokio1)
            .create_timeout(Some(CONNECT_TIMEOUT))
            .wait_timeout(Some(CONNECT_TIMEOUT))
            .build()
            .expect("a pool with a runtime and timeouts builds");
        Arc::new(Store {
            config,
            tls,
            pool,
            migrated: Default::default(),
            migrating: Mutex::new(()),
        })
    }

    /// A new connection, its driver spawned; `notified` gets a wake-up per notification.
    async fn connect(
        &self,
        notified: Option<mpsc::UnboundedSender<()>>,
    ) -> Result<(tokio_postgres::Client, tokio::task::JoinHandle<()>), StoreError> {
        let connected = async {
            match &self.tls {
                Some(tls) => {
                    let (client, connection) = self.config.connect(tls.clone()).await?;
                    Ok((client, tokio::spawn(drive(connection, notified))))
                }
                None => {
                    let (client, connection) = self.config.connect(tokio_postgres::NoTls).await?;
                    Ok((client, tokio::spawn(drive(connection, notified))))
                }
            }
        };
        tokio::time::timeout(CONNECT_TIMEOUT, connected)
            .await
            .map_err(|_| {
                StoreError::Unavailable(format!(
                    "no connection to the store within {CONNECT_TIMEOUT:?}"
                ))
            })?
            .map_err(|e: tokio_postgres::Error| {
                StoreError::Unavailable(format!("cannot connect to the store: {}", reason(&e)))
            })
    }

    /// A connection of the pool (waiting up to [`CONNECT_TIMEOUT`] for one to be free or
    /// opened); the first one brings the schema up to date.
    pub async fn client(&self) -> Result<Client, StoreError> {
        use std::sync::atomic::Ordering;
        let client = self.pool.get().await.map_err(|e| pool_error(&e))?;
        if !self.migrated.load(Ordering::Acquire) {
            let _one = self.migrating.lock().await;
            if !self.migrated.load(Ordering::Acquire) {
                migrations::apply(&client).await?;
                self.migrated.store(true, Ordering::Release);
                tracing::info!("store connected and its schema up to date");
            }
        }
        Ok(client)
    }
}

impl Store {
    /// Listens on `channel` on a connection of its own (opened again when it breaks)
    /// until `shutdown`; the receiver gets a wake-up for each notification (coalesced).
    pub fn listen(
        self: &Arc<Self>,
        channel: &'static str,
        shutdown: CancellationToken,
    ) -> mpsc::Receiver<()> {
        let (wake, woken) = mpsc::channel(1);
        let store = self.clone();
        tokio::spawn(async move {
            loop {
                let (notified, mut notifications) = mpsc::unbounded_channel();
                if let Ok((client, driver)) = store.connect(Some(notified)).await {
                    if client
                        .batch_execute(&format!("LISTEN {channel}"))
                        .await
                        .is_ok()
                    {
                        loop {
                            tokio::select! {
                                _ = shutdown.cancelled() => {
                                    driver.abort();
                                    return;
                                }
                                n = notifications.recv() => match n {
                                    Some(()) => { let _ = wake.try_send(()); }
                                    None => break,
                                },
                            }
                        }
                    }
                    driver.abort();
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

/// Drives a connection until it ends, passing notifications on to `notified`.
async fn drive<S, T>(
    mut connection: tokio_postgres::Connection<S, T>,
    notified: Option<mpsc::UnboundedSender<()>>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
    while let Some(message) = messages.next().await {
        match message {
            Ok(tokio_postgres::AsyncMessage::Notification(_)) => {
                if let Some(notified) = &notified {
                    let _ = notified.send(());
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %reason(&e), "the connection to the store broke");
                return;
            }
        }
    }
}

/// Why the pool gave no connection, in the words [`Store::client`] always used.
fn pool_error(e: &deadpool_postgres::PoolError) -> StoreError {
    use deadpool_postgres::PoolError;
    StoreError::Unavailable(match e {
        PoolError::Backend(e) => format!("cannot connect to the store: {}", reason(e)),
        PoolError::Timeout(_) => format!("no connection to the store within {CONNECT_TIMEOUT:?}"),
        other => format!("cannot connect to the store: {other}"),
    })
}

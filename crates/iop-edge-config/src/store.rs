//! The `store` section: the PostgreSQL database several edges share (optional; without it
//! everything stays in `state_dir`). Its URL comes from `url` or, when set, the edge's
//! `IOP_STORE_URL` environment variable. The link to a store on another machine is always
//! TLS, the server verified against `ca_file` (else the system's roots): a URL with a
//! password never crosses a network in the clear. On this machine (a loopback address or
//! a Unix socket directory) TLS is used when the URL says `sslmode=require`.
//!
//! The secret key seals what the store keeps secret (the fleet CA's private key): 32 random
//! bytes, base64, from `IOP_STORE_SECRET_KEY` or the file `secret_key_file` (0600), read
//! once when the config is read. Every edge of a fleet gets the same key; the store never
//! sees it.

#[cfg(feature = "store-url")]
use std::str::FromStr;

use serde::Deserialize;

use super::FieldError;

/// The environment variable that gives (and overrides) `store.url`.
pub const STORE_URL_ENV: &str = "IOP_STORE_URL";
/// The environment variable that gives (and overrides) the store's secret key.
pub const STORE_SECRET_KEY_ENV: &str = "IOP_STORE_SECRET_KEY";

/// How to make a secret key, for error messages.
pub const MAKE_A_KEY: &str = "make one with `head -c 32 /dev/urandom | base64 > store.key && chmod 600 store.key` and give every edge the same";

/// The key that seals the store's secrets (32 bytes). Never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct StoreSecretKey(pub [u8; 32]);

impl std::fmt::Debug for StoreSecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StoreSecretKey(..)")
    }
}

impl StoreSecretKey {
    /// Reads a key written as base64 (surrounding white space ignored).
    pub fn parse(text: &str) -> Result<Self, String> {
        use base64::Engine;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(text.trim())
            .map_err(|_| format!("is not base64; {MAKE_A_KEY}"))?;
        let key: [u8; 32] = bytes
            .try_into()
            .map_err(|b: Vec<u8>| format!("holds {} bytes, not 32; {MAKE_A_KEY}", b.len()))?;
        Ok(StoreSecretKey(key))
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// `postgres://user[:password]@host[:port]/database`, or the key/value form.
    #[serde(default)]
    pub url: Option<String>,
    /// This edge's name in the fleet (default: `<hostname>:<http port>`).
    #[serde(default)]
    pub edge_id: Option<String>,
    /// The `host:port` other machines' nodes reach this edge's node listener at; the
    /// fleet tells every node to link to it (default: the listener's address, unless it
    /// is a wildcard address, then `<hostname>:<port>`).
    #[serde(default)]
    pub node_address: Option<String>,
    /// PEM certificate(s) of the CA that signed the store server's certificate (default:
    /// the system's trusted roots).
    #[serde(default)]
    pub ca_file: Option<std::path::PathBuf>,
    /// A file holding the secret key (base64 of 32 bytes); `IOP_STORE_SECRET_KEY` wins.
    #[serde(default)]
    pub secret_key_file: Option<std::path::PathBuf>,
    /// The secret key, read from `IOP_STORE_SECRET_KEY` or `secret_key_file`.
    #[serde(skip)]
    pub secret_key: Option<StoreSecretKey>,
}

impl StoreConfig {
    /// The parsed URL, if a store is configured.
    #[cfg(feature = "store-url")]
    pub fn connect_config(&self) -> Option<Result<tokio_postgres::Config, FieldError>> {
        let url = self.url.as_deref()?;
        Some(parse(url))
    }

    /// Reads the secret key from `env_key` (the variable's value) or `secret_key_file`.
    pub fn resolve_secret_key(&mut self, env_key: Option<String>) -> Result<(), FieldError> {
        if let Some(text) = env_key.filter(|k| !k.trim().is_empty()) {
            let key = StoreSecretKey::parse(&text).map_err(|e| {
                FieldError::new(
                    "secret_key_file".into(),
                    format!("{STORE_SECRET_KEY_ENV} {e}"),
                )
            })?;
            self.secret_key = Some(key);
            return Ok(());
        }
        let Some(path) = &self.secret_key_file else {
            return Ok(());
        };
        let field = || "secret_key_file".to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| FieldError::new(field(), format!("{}: {e}", path.display())))?;
        {
            use std::os::unix::fs::PermissionsExt;
            if let Ok(meta) = std::fs::metadata(path)
                && meta.permissions().mode() & 0o077 != 0
            {
                return Err(FieldError::new(
                    field(),
                    format!(
                        "{} can be read by others: `chmod 600` it (it seals the fleet's CA key)",
                        path.display()
                    ),
                ));
            }
        }
        let key = StoreSecretKey::parse(&text)
            .map_err(|e| FieldError::new(field(), format!("{} {e}", path.display())))?;
        self.secret_key = Some(key);
        Ok(())
    }

    pub fn validate(&self) -> Result<(), FieldError> {
        #[cfg(feature = "store-url")]
        if let Some(parsed) = self.connect_config() {
            parsed?;
        }
        if let Some(address) = &self.node_address
            && (address.trim().is_empty()
                || !address.contains(':')
                || address.contains('/')
                || address.contains(',')
                || address.len() > 255)
        {
            return Err(FieldError::new(
                "node_address".into(),
                format!("{address:?} must be host:port"),
            ));
        }
        if let Some(id) = &self.edge_id
            && (id.is_empty() || id.len() > 128)
        {
            return Err(FieldError::new(
                "edge_id".into(),
                "give 1 to 128 characters".into(),
            ));
        }
        Ok(())
    }
}

/// Parses a store URL; errors never repeat it (it may hold a password).
#[cfg(feature = "store-url")]
fn parse(url: &str) -> Result<tokio_postgres::Config, FieldError> {
    let mut config = tokio_postgres::Config::from_str(url).map_err(|e| {
        FieldError::new(
            "url".into(),
            format!("not a PostgreSQL connection URL ({e}); e.g. postgres://iop@127.0.0.1/iop"),
        )
    })?;
    let remote = config.get_hosts().iter().any(|host| !match host {
        tokio_postgres::config::Host::Tcp(name) => {
            name == "localhost"
                || name
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback())
        }
        tokio_postgres::config::Host::Unix(_) => true,
    });
    if remote {
        if config.get_ssl_mode() == tokio_postgres::config::SslMode::Disable {
            return Err(FieldError::new(
                "url".into(),
                "sslmode=disable for a store on another machine: the link to it is always \
                 TLS (drop sslmode)"
                    .into(),
            ));
        }
        config.ssl_mode(tokio_postgres::config::SslMode::Require);
    }
    if config.get_hosts().is_empty() {
        return Err(FieldError::new(
            "url".into(),
            "names no host: give one, e.g. postgres://iop@127.0.0.1/iop".into(),
        ));
    }
    if config.get_dbname().is_none() {
        return Err(FieldError::new(
            "url".into(),
            "names no database: e.g. postgres://iop@127.0.0.1/iop".into(),
        ));
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(url: &str) -> StoreConfig {
        StoreConfig {
            url: Some(url.into()),
            ..Default::default()
        }
    }

    #[test]
    #[cfg(feature = "store-url")]
    fn a_store_on_another_machine_is_always_reached_over_tls() {
        use tokio_postgres::config::SslMode;
        let remote = store("postgres://iop:secret@db.example.net/iop")
            .connect_config()
            .unwrap()
            .unwrap();
        assert_eq!(remote.get_ssl_mode(), SslMode::Require);
        let local = store("postgres://iop@127.0.0.1/iop")
            .connect_config()
            .unwrap()
            .unwrap();
        assert_eq!(local.get_ssl_mode(), SslMode::Prefer);
        let clear = store("postgres://iop:secret@db.example.net/iop?sslmode=disable")
            .validate()
            .unwrap_err();
        assert!(clear.message.contains("always TLS"), "{}", clear.message);
        assert!(!clear.message.contains("secret"), "{}", clear.message);
    }

    #[test]
    #[cfg(feature = "store-url")]
    fn only_a_store_with_a_host_and_a_database_is_accepted() {
        assert!(
            store("postgres://iop:secret@127.0.0.1:5432/iop")
                .validate()
                .is_ok()
        );
        assert!(store("postgres://iop@localhost/iop").validate().is_ok());
        assert!(
            store("host=/run/postgresql user=iop dbname=iop")
                .validate()
                .is_ok()
        );
        assert!(store("postgres://iop@127.0.0.1").validate().is_err());
        let garbage = store("postgres://iop:hunter2@[::1").validate().unwrap_err();
        assert!(!garbage.message.contains("hunter2"), "{}", garbage.message);
        assert!(StoreConfig::default().validate().is_ok());
    }

    #[test]
    fn the_secret_key_is_32_bytes_of_base64_from_the_environment_or_a_private_file() {
        use std::os::unix::fs::PermissionsExt;
        let key = "A".repeat(43) + "=";
        let mut config = store("postgres://iop@127.0.0.1/iop");
        config.resolve_secret_key(Some(key.clone())).unwrap();
        assert_eq!(config.secret_key, Some(StoreSecretKey([0; 32])));
        assert!(!format!("{config:?}").contains(&key));
        let short = config.resolve_secret_key(Some("AAAA".into())).unwrap_err();
        assert!(
            short.message.contains("3 bytes, not 32"),
            "{}",
            short.message
        );

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("store.key");
        std::fs::write(&file, format!("{key}\n")).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let mut config = store("postgres://iop@127.0.0.1/iop");
        config.secret_key_file = Some(file.clone());
        let open = config.resolve_secret_key(None).unwrap_err();
        assert!(open.message.contains("chmod 600"), "{}", open.message);
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        config.resolve_secret_key(None).unwrap();
        assert!(config.secret_key.is_some());
    }
}

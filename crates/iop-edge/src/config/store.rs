//! The `store` section: the PostgreSQL database several edges share (optional; without it
//! everything stays in `state_dir`). Its URL comes from `url` or, when set, the edge's
//! `IOP_STORE_URL` environment variable. Until the link to the store is encrypted, its
//! host must be this machine (a loopback address or a Unix socket directory): a URL with
//! a password must not cross a network in the clear.

use std::str::FromStr;

use serde::Deserialize;

use super::FieldError;

/// The environment variable that gives (and overrides) `store.url`.
pub const STORE_URL_ENV: &str = "IOP_STORE_URL";

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// `postgres://user[:password]@host[:port]/database`, or the key/value form.
    #[serde(default)]
    pub url: Option<String>,
    /// This edge's name in the fleet (default: `<hostname>:<http port>`).
    #[serde(default)]
    pub edge_id: Option<String>,
}

impl StoreConfig {
    /// The parsed URL, if a store is configured.
    pub fn connect_config(&self) -> Option<Result<tokio_postgres::Config, FieldError>> {
        let url = self.url.as_deref()?;
        Some(parse(url))
    }

    pub fn validate(&self) -> Result<(), FieldError> {
        if let Some(parsed) = self.connect_config() {
            parsed?;
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
fn parse(url: &str) -> Result<tokio_postgres::Config, FieldError> {
    let config = tokio_postgres::Config::from_str(url).map_err(|e| {
        FieldError::new(
            "url".into(),
            format!("not a PostgreSQL connection URL ({e}); e.g. postgres://iop@127.0.0.1/iop"),
        )
    })?;
    for host in config.get_hosts() {
        let local = match host {
            tokio_postgres::config::Host::Tcp(name) => {
                name == "localhost"
                    || name
                        .parse::<std::net::IpAddr>()
                        .is_ok_and(|ip| ip.is_loopback())
            }
            tokio_postgres::config::Host::Unix(_) => true,
        };
        if !local {
            return Err(FieldError::new(
                "url".into(),
                "the store's host must be this machine (a loopback address or a Unix socket \
                 directory): the link to it is not encrypted yet"
                    .into(),
            ));
        }
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
            edge_id: None,
        }
    }

    #[test]
    fn only_a_local_store_with_a_database_is_accepted() {
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
        let remote = store("postgres://iop:secret@db.example.net/iop")
            .validate()
            .unwrap_err();
        assert!(
            remote.message.contains("this machine"),
            "{}",
            remote.message
        );
        assert!(!remote.message.contains("secret"), "{}", remote.message);
        assert!(store("postgres://iop@127.0.0.1").validate().is_err());
        let garbage = store("postgres://iop:hunter2@[::1").validate().unwrap_err();
        assert!(!garbage.message.contains("hunter2"), "{}", garbage.message);
        assert!(StoreConfig::default().validate().is_ok());
    }
}

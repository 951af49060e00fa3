//! Node tokens and API keys as the config gives them — inline (`token`), from an
//! environment variable of the edge (`token_env`), or as their SHA-256 (`token_sha256`) —
//! resolved once, when the config is read. Only the hash is kept: the inline text is
//! dropped and the variable is not read again, so validation and everything after it is
//! a pure function of the parsed config.

use sha2::{Digest, Sha256};

use super::FieldError;

/// SHA-256 of a node token or API key, the only form in which the edge keeps them.
pub type TokenHash = [u8; 32];

pub fn hash_token(token: &str) -> TokenHash {
    Sha256::digest(token.as_bytes()).into()
}

/// The three fields a secret may come from, by name (`token`, `token_env`,
/// `token_sha256`), with what the config says in each.
#[derive(Debug, Clone, Copy)]
pub struct SecretFields<'a> {
    pub inline: (&'static str, Option<&'a str>),
    pub env: (&'static str, Option<&'a str>),
    pub sha256: (&'static str, Option<&'a str>),
}

/// Where environment variables are read from (the process's own, or a test's).
pub type Env<'e> = &'e dyn Fn(&str) -> Option<String>;

/// The process environment.
pub fn process_env(var: &str) -> Option<String> {
    std::env::var(var).ok()
}

impl SecretFields<'_> {
    /// The field that gives the secret (for error paths): the first one set.
    pub fn given(&self) -> &'static str {
        [self.inline, self.env, self.sha256]
            .iter()
            .find(|(_, v)| v.is_some())
            .map_or(self.inline.0, |(name, _)| name)
    }

    /// The secret's hash, or `None` when no field gives one. A secret shorter than
    /// `min_chars` is refused (a short one is guessable).
    pub fn resolve(&self, min_chars: usize, env: Env<'_>) -> Result<Option<TokenHash>, FieldError> {
        let (inline, from_env, sha256) = (self.inline, self.env, self.sha256);
        let given = [inline.1, from_env.1, sha256.1];
        match given.iter().filter(|v| v.is_some()).count() {
            0 => return Ok(None),
            1 => {}
            _ => {
                return Err(FieldError::new(
                    inline.0.into(),
                    format!(
                        "give only one of {}, {} or {}",
                        inline.0, from_env.0, sha256.0
                    ),
                ));
            }
        }
        let long_enough = |secret: &str, field: &str, what: String| {
            if secret.chars().count() < min_chars {
                return Err(FieldError::new(
                    field.into(),
                    format!(
                        "{what}must be at least {min_chars} characters (a short one is \
                         guessable; `openssl rand -hex 24` makes a good one)"
                    ),
                ));
            }
            Ok(Some(hash_token(secret)))
        };
        if let Some(secret) = inline.1 {
            return long_enough(secret, inline.0, String::new());
        }
        if let Some(var) = from_env.1 {
            return match env(var) {
                Some(secret) if !secret.is_empty() => {
                    long_enough(&secret, from_env.0, format!("the value of {var} "))
                }
                _ => Err(FieldError::new(
                    from_env.0.into(),
                    format!("environment variable {var} is not set or empty"),
                )),
            };
        }
        let mut hash = [0u8; 32];
        hex::decode_to_slice(sha256.1.unwrap_or_default().trim(), &mut hash).map_err(|_| {
            FieldError::new(
                sha256.0.into(),
                "must be 64 hexadecimal characters (a SHA-256 digest)".into(),
            )
        })?;
        Ok(Some(hash))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields<'a>(
        inline: Option<&'a str>,
        env: Option<&'a str>,
        sha: Option<&'a str>,
    ) -> SecretFields<'a> {
        SecretFields {
            inline: ("token", inline),
            env: ("token_env", env),
            sha256: ("token_sha256", sha),
        }
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn each_source_gives_the_same_hash() {
        let secret = "a-secret-of-enough-length";
        let hex = hex::encode(hash_token(secret));
        let env = |var: &str| (var == "S").then(|| secret.to_string());
        let want = Some(hash_token(secret));
        assert_eq!(
            fields(Some(secret), None, None)
                .resolve(16, &no_env)
                .unwrap(),
            want
        );
        assert_eq!(
            fields(None, Some("S"), None).resolve(16, &env).unwrap(),
            want
        );
        assert_eq!(
            fields(None, None, Some(&hex)).resolve(16, &no_env).unwrap(),
            want
        );
        assert_eq!(fields(None, None, None).resolve(16, &no_env).unwrap(), None);
    }

    #[test]
    fn mistakes_name_their_field() {
        let path = |f: SecretFields<'_>| f.resolve(16, &no_env).unwrap_err().path;
        assert_eq!(path(fields(Some("x"), Some("S"), None)), "token");
        assert_eq!(path(fields(Some("short"), None, None)), "token");
        assert_eq!(path(fields(None, Some("UNSET"), None)), "token_env");
        assert_eq!(path(fields(None, None, Some("zz"))), "token_sha256");
    }
}

//! `GET /ui`: the live status page, one self-contained HTML file (inline CSS and script, no
//! external resources) compiled into the binary.
//!
//! The page itself holds no data and no secret, so it is served to anyone, like the probes.
//! It asks for an admin API key once, keeps it in the tab's session storage and sends it as
//! a bearer token on its fetches of `/admin/status` and `/admin/usage*`, which stay
//! admin-only. (A browser cannot send a bearer header when it navigates, and a cookie
//! would make the admin endpoints answer cross-site requests the browser adds it to.)
//!
//! The response carries a strict Content-Security-Policy: the inline script and style are
//! allowed by their SHA-256 digests only, fetches go to this origin only, nothing may frame
//! the page, and no form may submit anywhere.

use std::sync::{Arc, LazyLock};

use axum::Router;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use base64::Engine;
use sha2::{Digest, Sha256};

use crate::service::Edge;

/// The page, as served.
pub const PAGE: &str = include_str!("ui.html");

/// The page's Content-Security-Policy (computed once from the page).
static CSP: LazyLock<String> = LazyLock::new(|| content_security_policy(PAGE));

/// The open route of the page.
pub fn routes() -> Router<Arc<Edge>> {
    Router::new().route("/ui", get(page))
}

async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, CSP.as_str()),
            (header::CACHE_CONTROL, "no-store"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::X_FRAME_OPTIONS, "DENY"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        PAGE,
    )
        .into_response()
}

/// The policy for `page`: its inline `<script>` and `<style>` by digest, nothing else.
pub fn content_security_policy(page: &str) -> String {
    let script = digest(inline(page, "<script>", "</script>"));
    let style = digest(inline(page, "<style>", "</style>"));
    format!(
        "default-src 'none'; script-src '{script}'; style-src '{style}'; \
         connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; \
         frame-ancestors 'none'"
    )
}

/// The text between the first `open` tag and the next `close` tag (empty if there is none).
fn inline<'a>(page: &'a str, open: &str, close: &str) -> &'a str {
    page.split_once(open)
        .and_then(|(_, rest)| rest.split_once(close))
        .map_or("", |(body, _)| body)
}

fn digest(text: &str) -> String {
    let hash = Sha256::digest(text.as_bytes());
    format!(
        "sha256-{}",
        base64::engine::general_purpose::STANDARD.encode(hash)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_names_the_digests_of_the_one_script_and_one_style() {
        assert_eq!(PAGE.matches("<script").count(), 1, "one inline script");
        assert_eq!(PAGE.matches("<style").count(), 1, "one inline style");
        let script = inline(PAGE, "<script>", "</script>");
        assert!(script.contains("use strict"), "{script:.40}");
        let csp = content_security_policy(PAGE);
        assert!(csp.contains(&format!("script-src '{}'", digest(script))));
        assert!(!csp.contains("unsafe"), "{csp}");
        // The digest of a known text, as browsers compute it.
        assert_eq!(
            digest(""),
            "sha256-47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU="
        );
    }

    #[test]
    fn the_page_loads_nothing_from_elsewhere() {
        for needle in ["http://", "https://", "src=", "@import", "url("] {
            let outside = PAGE
                .match_indices(needle)
                .filter(|(at, _)| !PAGE[*at..].starts_with("http://www.w3.org/2000/svg"))
                .count();
            assert_eq!(outside, 0, "{needle} in the page");
        }
    }
}

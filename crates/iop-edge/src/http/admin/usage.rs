//! The usage ledger over HTTP (admin keys only): `GET /admin/usage` (usage summed per key,
//! group, node or provider, per hour, day or the whole range), `GET /admin/usage/records`
//! (the raw records, newest first) and `GET /admin/usage/live` (the last minute per model
//! group, from memory). Parameters are checked here; a bad one is a 400 naming it. Every
//! query is bounded: its time range, and the rows or records it returns.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Map, Value, json};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::canonical::ApiError;
use crate::http::error::HttpError;
use crate::ledger::live::WINDOW;
use crate::ledger::query::{self, Bucket, Filter, OutcomeFilter, Per, UsageRow};
use crate::ledger::{UsageRecord, unix_ms_now};
use crate::service::Edge;
use iop_proto::ErrorCode;

/// The range queried when `since` is not given.
pub const DEFAULT_RANGE: Duration = Duration::from_secs(24 * 3600);
/// Longest range summed per hour.
pub const MAX_HOURLY_RANGE_DAYS: i64 = 31;
/// Longest range of any query.
pub const MAX_RANGE_DAYS: i64 = 3_650;
/// Most rows of a summary (more: `truncated: true`).
pub const MAX_ROWS: usize = 10_000;
/// Records returned by default and at most.
pub const DEFAULT_RECORDS: usize = 100;
pub const MAX_RECORDS: usize = 1_000;
/// How long a query waits for the records already queued to be committed.
const FLUSH_WAIT: Duration = Duration::from_secs(2);

const DAY_MS: i64 = 86_400_000;

pub fn routes() -> Router<Arc<Edge>> {
    Router::new()
        .route("/admin/usage", get(summary))
        .route("/admin/usage/records", get(records))
        .route("/admin/usage/live", get(live))
}

type Params = Query<Vec<(String, String)>>;

/// The parameters every ledger query takes.
const FILTER_PARAMS: &[&str] = &["since", "until", "key", "group", "node"];

/// Refuses parameters other than `allowed`, and repeated ones.
fn check_names(params: &[(String, String)], allowed: &[&str]) -> Result<(), ApiError> {
    for (i, (name, _)) in params.iter().enumerate() {
        if !allowed.contains(&name.as_str()) {
            return Err(ApiError::invalid_param(
                name,
                format!(
                    "unknown parameter `{name}`; this endpoint takes {}",
                    allowed.join(", ")
                ),
            ));
        }
        if params[..i].iter().any(|(n, _)| n == name) {
            return Err(ApiError::invalid_param(
                name,
                format!("`{name}` is given more than once"),
            ));
        }
    }
    Ok(())
}

fn param<'a>(params: &'a [(String, String)], name: &str) -> Option<&'a str> {
    params
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// RFC 3339 or Unix seconds, in Unix milliseconds.
pub fn parse_time(name: &str, value: &str) -> Result<i64, ApiError> {
    if let Ok(secs) = value.parse::<i64>() {
        return secs
            .checked_mul(1000)
            .filter(|ms| *ms >= 0)
            .ok_or_else(|| bad_time(name, value));
    }
    OffsetDateTime::parse(value, &Rfc3339)
        .map(|t| (t.unix_timestamp_nanos() / 1_000_000) as i64)
        .ok()
        .filter(|ms| *ms >= 0)
        .ok_or_else(|| bad_time(name, value))
}

fn bad_time(name: &str, value: &str) -> ApiError {
    ApiError::invalid_param(
        name,
        format!(
            "`{name}` must be an RFC 3339 time (e.g. 2026-01-31T00:00:00Z) or Unix seconds; got {value:?}"
        ),
    )
}

/// Unix milliseconds as RFC 3339 (UTC).
pub fn rfc3339(ms: i64) -> String {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_default()
}

/// The filter of `params`, its range at most `max_days` long.
fn filter_of(params: &[(String, String)], max_days: i64) -> Result<Filter, ApiError> {
    let until_ms = match param(params, "until") {
        Some(v) => parse_time("until", v)?,
        None => unix_ms_now(),
    };
    let since_ms = match param(params, "since") {
        Some(v) => parse_time("since", v)?,
        None => until_ms - DEFAULT_RANGE.as_millis() as i64,
    };
    if since_ms >= until_ms {
        return Err(ApiError::invalid_param(
            "since",
            "`since` must be before `until`",
        ));
    }
    if until_ms - since_ms > max_days * DAY_MS {
        return Err(ApiError::invalid_param(
            "since",
            format!("the range from `since` to `until` may be at most {max_days} days here"),
        ));
    }
    let text = |name: &str| -> Result<Option<String>, ApiError> {
        match param(params, name) {
            Some("") => Err(ApiError::invalid_param(
                name,
                format!("`{name}` must not be empty"),
            )),
            Some(v) if v.len() > 256 => Err(ApiError::invalid_param(
                name,
                format!("`{name}` is longer than 256 bytes"),
            )),
            v => Ok(v.map(String::from)),
        }
    };
    Ok(Filter {
        since_ms,
        until_ms,
        key: text("key")?,
        group: text("group")?,
        node: text("node")?,
        outcome: None,
    })
}

fn ledger_off() -> ApiError {
    ApiError::of(
        ErrorCode::Unavailable,
        "the usage ledger is off on this edge (ledger.enabled: false)",
    )
    .with_detail("ledger_disabled")
}

fn read_failed(message: String) -> ApiError {
    tracing::error!(%message, "usage ledger query failed");
    ApiError::of(
        ErrorCode::Internal,
        format!("the usage ledger could not be read: {message}"),
    )
}

async fn summary(State(edge): State<Arc<Edge>>, Query(params): Params) -> Response {
    match summarize(&edge, &params).await {
        Ok(body) => axum::Json(body).into_response(),
        Err(e) => HttpError(e).into_response(),
    }
}

async fn summarize(edge: &Edge, params: &[(String, String)]) -> Result<Value, ApiError> {
    let mut allowed = FILTER_PARAMS.to_vec();
    allowed.extend(["by", "per", "scope"]);
    let fleet = match param(params, "scope").unwrap_or("edge") {
        "edge" => None,
        "fleet" => Some(
            edge.trust()
                .and_then(|t| t.shared().cloned())
                .ok_or_else(|| {
                    ApiError::invalid_param(
                        "scope",
                        "scope=fleet needs a fleet: this edge has no shared store (store.url)",
                    )
                })?,
        ),
        other => {
            return Err(ApiError::invalid_param(
                "scope",
                format!("`scope` must be edge or fleet; got {other:?}"),
            ));
        }
    };
    check_names(params, &allowed)?;
    let by = match param(params, "by").unwrap_or("total") {
        "hour" => Bucket::Hour,
        "day" => Bucket::Day,
        "total" => Bucket::Total,
        other => {
            return Err(ApiError::invalid_param(
                "by",
                format!("`by` must be hour, day or total; got {other:?}"),
            ));
        }
    };
    let mut per = Vec::new();
    for name in param(params, "per").unwrap_or("key,group").split(',') {
        let p = Per::parse(name.trim()).ok_or_else(|| {
            ApiError::invalid_param(
                "per",
                format!(
                    "`per` is a comma-separated list of key, group, node, provider, routing; got {name:?}"
                ),
            )
        })?;
        if per.contains(&p) {
            return Err(ApiError::invalid_param(
                "per",
                format!("`per` names {name:?} twice"),
            ));
        }
        per.push(p);
    }
    let max_days = if by == Bucket::Hour {
        MAX_HOURLY_RANGE_DAYS
    } else {
        MAX_RANGE_DAYS
    };
    let filter = filter_of(params, max_days)?;
    let (since_ms, until_ms) = (filter.since_ms, filter.until_ms);
    let scope = if fleet.is_some() { "fleet" } else { "edge" };
    let (rows, truncated) = match fleet {
        // Every edge's records as the store holds them (each edge ships its own within
        // a second or so).
        Some(store) => crate::ledger::ship::summarize_fleet(&store, &filter, by, &per, MAX_ROWS)
            .await
            .map_err(|e| {
                ApiError::of(
                    ErrorCode::Unavailable,
                    format!("the fleet's usage ledger could not be read: {e}"),
                )
                .with_detail("store_unavailable")
            })?,
        None => {
            if !edge.telemetry.ledger().is_enabled() {
                return Err(ledger_off());
            }
            edge.telemetry.ledger().flush(FLUSH_WAIT).await;
            let per_query = per.clone();
            edge.telemetry
                .ledger()
                .read(move |conn| query::summarize(conn, &filter, by, &per_query, MAX_ROWS))
                .await
                .map_err(read_failed)?
        }
    };
    Ok(json!({
        "since": rfc3339(since_ms),
        "until": rfc3339(until_ms),
        "by": by.as_str(),
        "scope": scope,
        "per": per.iter().map(|p| p.as_str()).collect::<Vec<_>>(),
        "rows": rows.iter().map(|r| row_json(r, &per)).collect::<Vec<_>>(),
        "truncated": truncated,
        "dropped_records": edge.telemetry.ledger().dropped(),
    }))
}

fn row_json(row: &UsageRow, per: &[Per]) -> Value {
    let mut out = Map::new();
    if let Some(start) = row.start_ms {
        out.insert("start".into(), rfc3339(start).into());
    }
    for (p, value) in per.iter().zip(&row.per) {
        out.insert(p.as_str().into(), value.clone().into());
    }
    for (name, n) in [
        ("requests", row.requests),
        ("ok", row.ok),
        ("failed", row.failed),
        ("input_tokens", row.input_tokens),
        ("output_tokens", row.output_tokens),
        ("reasoning_tokens", row.reasoning_tokens),
        ("cached_tokens", row.cached_tokens),
        ("est_input_tokens", row.est_input_tokens),
        ("est_output_tokens", row.est_output_tokens),
    ] {
        out.insert(name.into(), n.into());
    }
    Value::Object(out)
}

async fn records(State(edge): State<Arc<Edge>>, Query(params): Params) -> Response {
    match list_records(&edge, &params).await {
        Ok(body) => axum::Json(body).into_response(),
        Err(e) => HttpError(e).into_response(),
    }
}

async fn list_records(edge: &Edge, params: &[(String, String)]) -> Result<Value, ApiError> {
    let mut allowed = FILTER_PARAMS.to_vec();
    allowed.extend(["outcome", "limit"]);
    check_names(params, &allowed)?;
    let mut filter = filter_of(params, MAX_RANGE_DAYS)?;
    filter.outcome = match param(params, "outcome") {
        None => None,
        Some("ok") => Some(OutcomeFilter::Ok),
        Some("failed") => Some(OutcomeFilter::Failed),
        Some(code)
            if !code.is_empty()
                && code.len() <= 64
                && code
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b == b'_' || b.is_ascii_digit()) =>
        {
            Some(OutcomeFilter::Code(code.to_string()))
        }
        Some(other) => {
            return Err(ApiError::invalid_param(
                "outcome",
                format!(
                    "`outcome` must be ok, failed or an error code (e.g. queue_full); got {other:?}"
                ),
            ));
        }
    };
    let limit = match param(params, "limit") {
        None => DEFAULT_RECORDS,
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_RECORDS).contains(n))
            .ok_or_else(|| {
                ApiError::invalid_param(
                    "limit",
                    format!("`limit` must be an integer from 1 to {MAX_RECORDS}; got {v:?}"),
                )
            })?,
    };
    if !edge.telemetry.ledger().is_enabled() {
        return Err(ledger_off());
    }
    edge.telemetry.ledger().flush(FLUSH_WAIT).await;
    let records = edge
        .telemetry
        .ledger()
        .read(move |conn| query::records(conn, &filter, limit))
        .await
        .map_err(read_failed)?;
    Ok(json!({
        "records": records.iter().map(record_json).collect::<Vec<_>>(),
        "dropped_records": edge.telemetry.ledger().dropped(),
    }))
}

/// A record as the API shows it.
pub fn record_json(r: &UsageRecord) -> Value {
    json!({
        "time": rfc3339(r.time_ms),
        "key": r.key,
        "group": r.group,
        "node": r.node,
        "provider": r.provider,
        "path": r.path,
        "api": r.api,
        "input_tokens": r.input_tokens,
        "output_tokens": r.output_tokens,
        "reasoning_tokens": r.reasoning_tokens,
        "cached_tokens": r.cached_tokens,
        "est_input_tokens": r.est_input_tokens,
        "est_output_tokens": r.est_output_tokens,
        "latency_ms": r.latency_ms,
        "ttft_ms": r.ttft_ms,
        "outcome": r.outcome,
        "status": r.status,
        "attempts": r.attempts,
        "routing": r.routing,
    })
}

async fn live(State(edge): State<Arc<Edge>>, Query(params): Params) -> Response {
    if let Err(e) = check_names(&params, &[]) {
        return HttpError(e).into_response();
    }
    axum::Json(json!({
        "window_sec": WINDOW.as_secs(),
        "groups": edge.telemetry.live_usage(),
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn times_are_rfc3339_or_unix_seconds() {
        assert_eq!(
            parse_time("since", "1700000000").unwrap(),
            1_700_000_000_000
        );
        assert_eq!(
            parse_time("since", "2023-11-14T22:13:20Z").unwrap(),
            1_700_000_000_000
        );
        assert_eq!(
            parse_time("since", "2023-11-14T23:13:20+01:00").unwrap(),
            1_700_000_000_000
        );
        for bad in ["yesterday", "-5", "2023-11-14", ""] {
            let e = parse_time("since", bad).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("since"), "{bad}");
        }
        assert_eq!(rfc3339(1_700_000_000_000), "2023-11-14T22:13:20Z");
    }

    #[test]
    fn a_bad_filter_names_its_parameter() {
        let e = filter_of(&pairs(&[("since", "200"), ("until", "100")]), 10).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("since"));
        let e = filter_of(&pairs(&[("since", "0"), ("until", "8640000")]), 10).unwrap_err();
        assert!(e.message.contains("at most 10 days"), "{}", e.message);
        let e = filter_of(&pairs(&[("key", "")]), 10).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("key"));
        let f = filter_of(&pairs(&[("group", "g")]), 10).unwrap();
        assert_eq!(f.until_ms - f.since_ms, DEFAULT_RANGE.as_millis() as i64);
        assert_eq!(f.group.as_deref(), Some("g"));
        let e = check_names(&pairs(&[("keys", "a")]), FILTER_PARAMS).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("keys"));
        let e = check_names(&pairs(&[("key", "a"), ("key", "b")]), FILTER_PARAMS).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("key"));
    }
}

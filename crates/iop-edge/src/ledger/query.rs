//! Reading the ledger: usage summed per key / group / node / provider and per hour, day or
//! the whole range ([`summarize`]), the raw records newest first ([`records`]), and the
//! tokens each key used since a moment ([`tokens_by_key_since`], for `tokens_per_day`).
//! Every query is bounded by its time range and a row limit.

use rusqlite::types::Value as SqlValue;
use rusqlite::{Connection, params_from_iter};

use super::record::UsageRecord;
use crate::routing::Decision;

/// Which rows a query reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// `[since_ms, until_ms)`, milliseconds since the Unix epoch.
    pub since_ms: i64,
    pub until_ms: i64,
    pub key: Option<String>,
    pub group: Option<String>,
    pub node: Option<String>,
    pub outcome: Option<OutcomeFilter>,
}

/// `outcome=ok|failed|<code>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutcomeFilter {
    Ok,
    Failed,
    Code(String),
}

/// The buckets rows are summed over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bucket {
    Hour,
    Day,
    Total,
}

impl Bucket {
    pub fn as_str(self) -> &'static str {
        match self {
            Bucket::Hour => "hour",
            Bucket::Day => "day",
            Bucket::Total => "total",
        }
    }

    /// The bucket's length in milliseconds (`None` for the whole range).
    pub fn millis(self) -> Option<i64> {
        match self {
            Bucket::Hour => Some(3_600_000),
            Bucket::Day => Some(86_400_000),
            Bucket::Total => None,
        }
    }
}

/// A dimension rows are summed per.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Per {
    Key,
    Group,
    Node,
    Provider,
    /// How the member was picked (`session/hit`, `prefix/cold`, …).
    Routing,
}

impl Per {
    pub fn as_str(self) -> &'static str {
        match self {
            Per::Key => "key",
            Per::Group => "group",
            Per::Node => "node",
            Per::Provider => "provider",
            Per::Routing => "routing",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "key" => Some(Per::Key),
            "group" => Some(Per::Group),
            "node" => Some(Per::Node),
            "provider" => Some(Per::Provider),
            "routing" => Some(Per::Routing),
            _ => None,
        }
    }

    /// The column (a fixed name: never text from a request).
    fn column(self) -> &'static str {
        match self {
            Per::Key => "key",
            Per::Group => "grp",
            Per::Node => "node",
            Per::Provider => "provider",
            Per::Routing => "routing",
        }
    }
}

/// One summed row.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageRow {
    /// The bucket's start (ms); `None` for [`Bucket::Total`].
    pub start_ms: Option<i64>,
    /// The values of the `per` dimensions, in the order asked.
    pub per: Vec<String>,
    pub requests: u64,
    pub ok: u64,
    pub failed: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub reasoning_tokens: u64,
    pub cached_tokens: u64,
    /// Estimated tokens of the requests whose provider reported none.
    pub est_input_tokens: u64,
    pub est_output_tokens: u64,
}

/// How a database spells what the summary needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// The edge's own ledger (`?` parameters).
    Sqlite,
    /// The fleet's ledger in the store (`$n` parameters).
    Postgres,
}

/// A query parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Arg {
    Integer(i64),
    Text(String),
}

/// The WHERE clause of `filter` and its parameters (`?`, or `$1`, `$2`, …).
fn where_clause(filter: &Filter, dialect: Dialect) -> (String, Vec<Arg>) {
    let mut args = vec![Arg::Integer(filter.since_ms), Arg::Integer(filter.until_ms)];
    let mut conditions = vec!["time_ms >= {}".to_string(), "time_ms < {}".to_string()];
    for (column, value) in [
        ("key", &filter.key),
        ("grp", &filter.group),
        ("node", &filter.node),
    ] {
        if let Some(value) = value {
            conditions.push(format!("{column} = {{}}"));
            args.push(Arg::Text(value.clone()));
        }
    }
    match &filter.outcome {
        None => {}
        Some(OutcomeFilter::Ok) => conditions.push("outcome = 'ok'".into()),
        Some(OutcomeFilter::Failed) => conditions.push("outcome <> 'ok'".into()),
        Some(OutcomeFilter::Code(code)) => {
            conditions.push("outcome = {}".into());
            args.push(Arg::Text(code.clone()));
        }
    }
    // Number the placeholders in order.
    let mut n = 0;
    let sql = conditions
        .iter()
        .map(|c| {
            if c.contains("{}") {
                n += 1;
                let mark = match dialect {
                    Dialect::Sqlite => "?".to_string(),
                    Dialect::Postgres => format!("${n}"),
                };
                c.replace("{}", &mark)
            } else {
                c.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(" AND ");
    (sql, args)
}

fn sqlite_args(args: Vec<Arg>) -> impl Iterator<Item = SqlValue> {
    args.into_iter().map(|a| match a {
        Arg::Integer(n) => SqlValue::Integer(n),
        Arg::Text(t) => SqlValue::Text(t),
    })
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// The summary's SQL over `table` and its parameters: per `bucket` and `per`, at most
/// `max_rows + 1` rows (to tell a truncated answer).
pub fn summary_sql(
    table: &str,
    filter: &Filter,
    bucket: Bucket,
    per: &[Per],
    max_rows: usize,
    dialect: Dialect,
) -> (String, Vec<Arg>) {
    let (condition, args) = where_clause(filter, dialect);
    let mut select = Vec::new();
    let mut group_by = Vec::new();
    if let Some(ms) = bucket.millis() {
        select.push(format!("(time_ms / {ms}) * {ms}"));
        group_by.push("1".to_string());
    }
    for (i, p) in per.iter().enumerate() {
        select.push(p.column().to_string());
        group_by.push((i + 1 + usize::from(bucket != Bucket::Total)).to_string());
    }
    let sum = |expr: &str| match dialect {
        Dialect::Sqlite => format!("SUM({expr})"),
        // PostgreSQL sums BIGINT to NUMERIC: back to BIGINT for the driver.
        Dialect::Postgres => format!("SUM({expr})::BIGINT"),
    };
    select.push(match dialect {
        Dialect::Sqlite => "COUNT(*)".to_string(),
        Dialect::Postgres => "COUNT(*)::BIGINT".to_string(),
    });
    select.push(match dialect {
        Dialect::Sqlite => "SUM(outcome = 'ok')".to_string(),
        Dialect::Postgres => sum("CASE WHEN outcome = 'ok' THEN 1 ELSE 0 END"),
    });
    for column in [
        "input_tokens",
        "output_tokens",
        "reasoning_tokens",
        "cached_tokens",
        "est_input_tokens",
        "est_output_tokens",
    ] {
        select.push(sum(column));
    }
    let grouping = if group_by.is_empty() {
        String::new()
    } else {
        format!(" GROUP BY {0} ORDER BY {0}", group_by.join(", "))
    };
    let sql = format!(
        "SELECT {} FROM {table} WHERE {condition}{grouping} LIMIT {}",
        select.join(", "),
        max_rows + 1
    );
    (sql, args)
}

/// One summary row from its columns as [`summary_sql`] selects them: `int(i)` and
/// `text(i)` read column `i`. `None` for the empty whole-range row.
pub fn summary_row<E>(
    bucket: Bucket,
    per: &[Per],
    int: impl Fn(usize) -> Result<Option<i64>, E>,
    text: impl Fn(usize) -> Result<String, E>,
) -> Result<Option<UsageRow>, E> {
    let mut i = 0;
    let start_ms = match bucket {
        Bucket::Total => None,
        _ => {
            i += 1;
            Some(int(0)?.unwrap_or(0))
        }
    };
    let mut values = Vec::with_capacity(per.len());
    for _ in per {
        values.push(text(i)?);
        i += 1;
    }
    let requests = count(int(i)?.unwrap_or(0));
    if requests == 0 {
        // The whole-range sum of an empty range is one row of zeros (and NULL sums).
        return Ok(None);
    }
    let sum = |j: usize| -> Result<u64, E> { Ok(count(int(i + j)?.unwrap_or(0))) };
    let ok = sum(1)?;
    Ok(Some(UsageRow {
        start_ms,
        per: values,
        requests,
        ok,
        failed: requests - ok.min(requests),
        input_tokens: sum(2)?,
        output_tokens: sum(3)?,
        reasoning_tokens: sum(4)?,
        cached_tokens: sum(5)?,
        est_input_tokens: sum(6)?,
        est_output_tokens: sum(7)?,
    }))
}

/// Usage summed per `per` and `bucket`, ordered by bucket then the `per` values; at most
/// `max_rows` rows, and whether more existed.
pub fn summarize(
    conn: &Connection,
    filter: &Filter,
    bucket: Bucket,
    per: &[Per],
    max_rows: usize,
) -> rusqlite::Result<(Vec<UsageRow>, bool)> {
    let (sql, args) = summary_sql("requests", filter, bucket, per, max_rows, Dialect::Sqlite);
    let args = sqlite_args(args);
    let mut statement = conn.prepare(&sql)?;
    let mut rows = statement.query(params_from_iter(args))?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        if let Some(summed) = summary_row(bucket, per, |i| row.get(i), |i| row.get(i))? {
            out.push(summed);
        }
    }
    let truncated = out.len() > max_rows;
    out.truncate(max_rows);
    Ok((out, truncated))
}

/// The records `filter` selects, newest first, at most `limit`.
pub fn records(
    conn: &Connection,
    filter: &Filter,
    limit: usize,
) -> rusqlite::Result<Vec<UsageRecord>> {
    let (condition, args) = where_clause(filter, Dialect::Sqlite);
    let args = sqlite_args(args);
    let sql = format!(
        "SELECT time_ms, key, grp, node, provider, path, api, input_tokens, output_tokens, \
         reasoning_tokens, cached_tokens, latency_ms, ttft_ms, outcome, status, attempts, \
         est_input_tokens, est_output_tokens, routing FROM requests WHERE {condition} ORDER BY time_ms DESC, id DESC LIMIT {limit}"
    );
    let mut statement = conn.prepare(&sql)?;
    let rows = statement.query_map(params_from_iter(args), |row| {
        Ok(UsageRecord {
            time_ms: row.get(0)?,
            key: row.get(1)?,
            group: row.get(2)?,
            node: row.get(3)?,
            provider: row.get(4)?,
            path: static_path(&row.get::<_, String>(5)?),
            api: static_api(&row.get::<_, String>(6)?),
            input_tokens: count(row.get(7)?),
            output_tokens: count(row.get(8)?),
            reasoning_tokens: count(row.get(9)?),
            cached_tokens: count(row.get(10)?),
            latency_ms: count(row.get(11)?),
            ttft_ms: row.get::<_, Option<i64>>(12)?.map(count),
            outcome: row.get(13)?,
            status: row.get(14)?,
            attempts: row.get(15)?,
            est_input_tokens: row.get::<_, Option<i64>>(16)?.map(count),
            est_output_tokens: row.get::<_, Option<i64>>(17)?.map(count),
            routing: Decision::parse(&row.get::<_, String>(18)?).map_or("", Decision::as_str),
        })
    })?;
    rows.collect()
}

/// The tokens per key of the records since `since_ms`, as `tokens_per_day` counts them
/// (input plus output as reported, or as estimated where nothing was reported).
pub fn tokens_by_key_since(
    conn: &Connection,
    since_ms: i64,
) -> rusqlite::Result<Vec<(String, u64)>> {
    let mut statement = conn.prepare(
        "SELECT key, SUM(CASE WHEN input_tokens > 0 OR output_tokens > 0 \
         THEN input_tokens + output_tokens \
         ELSE COALESCE(est_input_tokens, 0) + COALESCE(est_output_tokens, 0) END) \
         FROM requests WHERE time_ms >= ?1 GROUP BY key",
    )?;
    let rows = statement.query_map([since_ms], |row| {
        Ok((row.get::<_, String>(0)?, count(row.get(1)?)))
    })?;
    rows.collect()
}

fn static_path(path: &str) -> &'static str {
    match path {
        "tunnel" => "tunnel",
        "run" => "run",
        _ => "none",
    }
}

fn static_api(api: &str) -> &'static str {
    match api {
        "openai" => "openai",
        "responses" => "responses",
        "messages" => "messages",
        "ollama" => "ollama",
        "runs" => "runs",
        "count_tokens" => "count_tokens",
        _ => "unknown",
    }
}

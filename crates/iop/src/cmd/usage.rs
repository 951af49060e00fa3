//! `iop usage`: usage from a running edge's ledger (`GET /admin/usage`), summed per key,
//! model group, node, provider or routing decision and per hour, day or the whole range — as a table, CSV
//! or the JSON answer.

use serde_json::Value;

use super::edge_api::EdgeApi;

#[derive(Debug, clap::Args)]
#[command(after_help = "\
Times are RFC 3339 (2026-01-31T00:00:00Z) or Unix seconds; the default range is the last 24
hours. Summing per hour covers at most 31 days. Requests are counted whatever ended them:
`failed` counts errors, refusals and clients that left before the end. Tokens are what
the providers reported.

Examples:
  iop usage                                  per key and model group, last 24 h
  iop usage --by day --since 2026-01-01T00:00:00Z --per key
  iop usage --key team-a --by hour --format csv > team-a.csv
  iop usage --fleet                          every edge of the fleet (a shared store)")]
pub struct Args {
    #[command(flatten)]
    api: EdgeApi,
    /// Start of the range (RFC 3339 or Unix seconds; default 24 h before --until).
    #[arg(long)]
    since: Option<String>,
    /// End of the range (RFC 3339 or Unix seconds; default now).
    #[arg(long)]
    until: Option<String>,
    /// Only this API key (by name).
    #[arg(long)]
    key: Option<String>,
    /// Only this model group.
    #[arg(long)]
    group: Option<String>,
    /// Only this node.
    #[arg(long)]
    node: Option<String>,
    /// Buckets: hour, day or total.
    #[arg(long, default_value = "total", value_parser = ["hour", "day", "total"])]
    by: String,
    /// Sum per these, comma-separated: key, group, node, provider, routing (how the
    /// member was picked: session/hit, prefix/cold, …).
    #[arg(long, default_value = "key,group")]
    per: String,
    /// table, csv or json.
    #[arg(long, default_value = "table", value_parser = ["table", "csv", "json"])]
    format: String,
    /// The whole fleet's usage (edges sharing a store), not only this edge's.
    #[arg(long)]
    fleet: bool,
}

/// The counts of a row, in column order.
const COUNTS: &[&str] = &[
    "requests",
    "ok",
    "failed",
    "input_tokens",
    "output_tokens",
    "reasoning_tokens",
    "cached_tokens",
];

pub async fn run(args: Args) -> super::Result {
    let client = args.api.client()?;
    let mut query: Vec<(&str, &str)> = vec![("by", &args.by), ("per", &args.per)];
    if args.fleet {
        query.push(("scope", "fleet"));
    }
    for (name, value) in [
        ("since", &args.since),
        ("until", &args.until),
        ("key", &args.key),
        ("group", &args.group),
        ("node", &args.node),
    ] {
        if let Some(v) = value {
            query.push((name, v));
        }
    }
    let url = reqwest::Url::parse_with_params(&args.api.url("/admin/usage"), &query)
        .map_err(|e| format!("{}: {e}", args.api.url))?;
    let body = args.api.send(client.get(url)).await?;
    match args.format.as_str() {
        "json" => println!("{}", serde_json::to_string_pretty(&body)?),
        "csv" => print!("{}", csv(&body)),
        _ => print!("{}", table(&body)),
    }
    Ok(())
}

/// The header and cells of every row.
fn cells(body: &Value) -> (Vec<String>, Vec<Vec<String>>) {
    let per: Vec<String> = body["per"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p.as_str().map(String::from))
        .collect();
    let bucketed = body["by"] != "total";
    let mut header = Vec::new();
    if bucketed {
        header.push("start".to_string());
    }
    header.extend(per.iter().cloned());
    header.extend(COUNTS.iter().map(|c| c.to_string()));
    let rows = body["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|row| {
            header
                .iter()
                .map(|column| match &row[column.as_str()] {
                    Value::String(s) => s.clone(),
                    Value::Null => String::new(),
                    other => other.to_string(),
                })
                .collect()
        })
        .collect();
    (header, rows)
}

fn table(body: &Value) -> String {
    let (header, rows) = cells(body);
    let mut widths: Vec<usize> = header.iter().map(String::len).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let counts_from = header.len() - COUNTS.len();
    let line = |cells: &[String]| {
        let mut out = cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                if i >= counts_from {
                    format!("{c:>w$}", w = widths[i])
                } else {
                    format!("{c:<w$}", w = widths[i])
                }
            })
            .collect::<Vec<_>>()
            .join("  ");
        out.truncate(out.trim_end().len());
        out.push('\n');
        out
    };
    let upper: Vec<String> = header.iter().map(|h| h.to_uppercase()).collect();
    let mut out = line(&upper);
    for row in &rows {
        out.push_str(&line(row));
    }
    out.push_str(&format!(
        "{} to {}: {} row(s){}",
        body["since"].as_str().unwrap_or(""),
        body["until"].as_str().unwrap_or(""),
        rows.len(),
        if body["truncated"] == true {
            " (truncated: narrow the range or the filters)"
        } else {
            ""
        }
    ));
    match body["dropped_records"].as_u64() {
        Some(n) if n > 0 => out.push_str(&format!(
            "; WARNING: {n} record(s) were dropped by the ledger since the edge started (see its log)\n"
        )),
        _ => out.push('\n'),
    }
    out
}

/// RFC 4180: fields with a comma, quote or line break are quoted, quotes doubled.
fn csv_field(field: &str) -> String {
    if field.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", field.replace('"', "\"\""))
    } else {
        field.to_string()
    }
}

fn csv(body: &Value) -> String {
    let (header, rows) = cells(body);
    let mut out = String::new();
    for row in std::iter::once(&header).chain(&rows) {
        let fields: Vec<String> = row.iter().map(|f| csv_field(f)).collect();
        out.push_str(&fields.join(","));
        out.push_str("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn answer() -> Value {
        json!({
            "since": "2026-01-01T00:00:00Z", "until": "2026-01-02T00:00:00Z",
            "by": "hour", "per": ["key", "group"], "truncated": false, "dropped_records": 0,
            "rows": [{"start": "2026-01-01T10:00:00Z", "key": "team,a", "group": "g",
                      "requests": 3, "ok": 2, "failed": 1, "input_tokens": 9,
                      "output_tokens": 32, "reasoning_tokens": 0, "cached_tokens": 0}]
        })
    }

    #[test]
    fn csv_has_a_header_and_quotes_what_needs_it() {
        assert_eq!(
            csv(&answer()),
            "start,key,group,requests,ok,failed,input_tokens,output_tokens,reasoning_tokens,cached_tokens\r\n\
             2026-01-01T10:00:00Z,\"team,a\",g,3,2,1,9,32,0,0\r\n"
        );
    }

    #[test]
    fn the_table_aligns_its_columns() {
        let t = table(&answer());
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("START "), "{t}");
        assert!(lines[1].contains("team,a"), "{t}");
        assert!(lines[2].contains("1 row(s)"), "{t}");
        let total = |b: &str| b.find("REQUESTS").map(|i| i + "REQUESTS".len());
        assert_eq!(total(lines[0]), lines[1].find(" 3").map(|i| i + 2), "{t}");
    }
}

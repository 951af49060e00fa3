//! `iop join-token`: asks a running edge for a join token for one of its configured nodes
//! and prints the join string (the only time its secret is shown). `--list` and `--delete`
//! manage the tokens that exist.

use serde_json::json;

use super::edge_api::EdgeApi;

#[derive(Debug, clap::Args)]
#[command(after_help = "\
Prints one line, the join string, on stdout; on the node run:
    iop node --join '<join string>'
The node verifies the edge by the pin in the string, receives its own long-lived credential
and keeps it in its state file; the token itself is then used up (--uses) or expires (--ttl).")]
pub struct Args {
    /// The node id (from the edge config's nodes[]) the token is for.
    #[arg(long, required_unless_present_any = ["list", "delete"])]
    node: Option<String>,
    /// How long the token can be used: seconds, or with a unit (30m, 24h, 7d).
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    ttl: u64,
    /// How many registrations it is good for.
    #[arg(long, default_value_t = 1)]
    uses: u32,
    /// host:port nodes dial (default: the edge's node_tls.advertise, or its listen address).
    /// Repeat for several.
    #[arg(long = "edge", value_name = "HOST:PORT")]
    edges: Vec<String>,
    /// List the join tokens (without secrets) instead.
    #[arg(long, conflicts_with_all = ["node", "delete"])]
    list: bool,
    /// Delete the join token with this id instead.
    #[arg(long, value_name = "ID", conflicts_with = "node")]
    delete: Option<String>,
    #[command(flatten)]
    api: EdgeApi,
}

/// `90`, `90s`, `30m`, `24h`, `7d` → seconds.
pub fn parse_duration(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (number, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => text.split_at(i),
        None => (text, "s"),
    };
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration like 90s, 30m, 24h or 7d"))?;
    let scale = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("{text:?}: the unit must be s, m, h or d")),
    };
    Ok(n * scale)
}

pub async fn run(args: Args) -> super::Result {
    let client = args.api.client()?;
    if args.list {
        let body = args
            .api
            .send(client.get(args.api.url("/admin/join-tokens")))
            .await?;
        let tokens = body["join_tokens"].as_array().cloned().unwrap_or_default();
        print!("{}", token_table(&tokens, super::status::now_ms()));
        return Ok(());
    }
    if let Some(id) = &args.delete {
        args.api
            .send(client.delete(args.api.url(&format!("/admin/join-tokens/{id}"))))
            .await?;
        eprintln!("join token {id} deleted");
        return Ok(());
    }
    let node = args.node.expect("clap requires --node");
    let body = args
        .api
        .send(
            client
                .post(args.api.url("/admin/join-tokens"))
                .json(&json!({
                    "node": node,
                    "ttl_sec": args.ttl,
                    "uses": args.uses,
                    "edges": args.edges,
                })),
        )
        .await?;
    let join = body["join"]
        .as_str()
        .ok_or("the edge sent no join string")?;
    println!("{join}");
    eprintln!(
        "join token {} for node {node}: {} use(s), valid {}s. On the node run:\n    iop node --join '{join}'",
        body["id"].as_str().unwrap_or(""),
        args.uses,
        args.ttl
    );
    Ok(())
}

/// The join tokens as an aligned table: id, node, uses left of how many, and when each
/// expires ("in 23h", or "expired").
fn token_table(tokens: &[serde_json::Value], now_ms: u64) -> String {
    let rows: Vec<[String; 4]> = tokens
        .iter()
        .map(|t| {
            let text = |k: &str| t[k].as_str().unwrap_or("").to_string();
            let count = |k: &str| t[k].as_u64().map_or_else(|| "-".into(), |n| n.to_string());
            let expires = t["expires_unix_ms"]
                .as_u64()
                .map_or_else(|| "-".into(), |ms| super::status::expiry_at(ms, now_ms));
            [
                text("id"),
                text("node"),
                format!("{} of {}", count("uses_left"), count("uses")),
                expires,
            ]
        })
        .collect();
    let header = ["ID", "NODE", "USES LEFT", "EXPIRES"];
    let width = |i: usize| {
        rows.iter()
            .map(|r| r[i].len())
            .chain([header[i].len()])
            .max()
            .unwrap_or(0)
    };
    let widths = [width(0), width(1), width(2)];
    let line = |cells: [&str; 4]| {
        format!(
            "{:<w0$}  {:<w1$}  {:<w2$}  {}\n",
            cells[0],
            cells[1],
            cells[2],
            cells[3],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2]
        )
    };
    let mut out = line(header);
    for r in &rows {
        out.push_str(&line([&r[0], &r[1], &r[2], &r[3]]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{parse_duration, token_table};
    use serde_json::json;

    #[test]
    fn the_token_list_is_aligned_and_says_what_expired() {
        let now = 1_000_000_000_000;
        let tokens = [
            json!({"id": "1f2e3d4c5b6a7980", "node": "gpu-box", "uses": 1, "uses_left": 1,
                   "expires_unix_ms": now + 23 * 3_600_000 + 59 * 60_000}),
            json!({"id": "aa", "node": "a-much-longer-node-name", "uses": 10, "uses_left": 0,
                   "expires_unix_ms": now - 1}),
        ];
        let table = token_table(&tokens, now);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 3, "{table}");
        let column = |l: &str| {
            l.find("EXPIRES")
                .or_else(|| l.find("in "))
                .or_else(|| l.find("expired"))
        };
        assert_eq!(column(lines[0]), column(lines[1]), "{table}");
        assert_eq!(column(lines[1]), column(lines[2]), "{table}");
        assert!(
            lines[1].contains("1 of 1") && lines[1].ends_with("in 23h"),
            "{table}"
        );
        assert!(
            lines[2].contains("0 of 10") && lines[2].ends_with("expired"),
            "{table}"
        );
    }

    #[test]
    fn durations_take_units() {
        assert_eq!(parse_duration("90"), Ok(90));
        assert_eq!(parse_duration("30m"), Ok(1800));
        assert_eq!(parse_duration("24h"), Ok(86_400));
        assert_eq!(parse_duration("7d"), Ok(604_800));
        assert!(parse_duration("1w").is_err());
        assert!(parse_duration("h").is_err());
    }
}

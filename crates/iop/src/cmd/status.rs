//! `iop status`: prints an edge's `/admin/status` as a table (or raw JSON).

use serde_json::Value;

use super::edge_api::EdgeApi;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    api: EdgeApi,
    /// Print the JSON snapshot as it is.
    #[arg(long)]
    json: bool,
}

// Over 100 lines: the status page's sections in the order they print; each is a few
// lines of one table.
pub async fn run(args: Args) -> super::Result {
    let client = args.api.client()?;
    let body = args
        .api
        .send(client.get(args.api.url("/admin/status")))
        .await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&body)?);
        return Ok(());
    }
    println!(
        "{:<16} {:<12} {:<16} {:<14} {:<12} {:<10} {:>10} {:>10}",
        "NODE", "STATE", "PROVIDER", "KIND", "STATUS", "HEALTH", "CAP n/l", "BUSY n/l"
    );
    let lanes = |v: &Value| format!("{}/{}", v["normal"], v["long"]);
    let mut notes = Vec::new();
    for node in body["nodes"].as_array().into_iter().flatten() {
        let providers = node["providers"].as_array().cloned().unwrap_or_default();
        if providers.is_empty() {
            println!(
                "{:<16} {:<12}",
                node["id"].as_str().unwrap_or(""),
                node["state"].as_str().unwrap_or("")
            );
        }
        for p in providers {
            let ejected = p["ejected"].is_object();
            println!(
                "{:<16} {:<12} {:<16} {:<14} {:<12} {:<10} {:>10} {:>10}",
                node["id"].as_str().unwrap_or(""),
                node["state"].as_str().unwrap_or(""),
                p["id"].as_str().unwrap_or(""),
                p["kind"].as_str().unwrap_or(""),
                if ejected {
                    "ejected"
                } else {
                    p["status"].as_str().unwrap_or("")
                },
                p["health"].as_str().unwrap_or(""),
                lanes(&p["capacity"]),
                lanes(&p["in_flight"]),
            );
            let name = format!(
                "{}/{}",
                node["id"].as_str().unwrap_or(""),
                p["id"].as_str().unwrap_or("")
            );
            if ejected {
                notes.push(format!(
                    "{name}: ejected for {}s more: {}",
                    p["ejected"]["remaining_sec"],
                    p["ejected"]["reason"].as_str().unwrap_or("")
                ));
            }
            let lanes_total = p["capacity"]["normal"].as_u64().unwrap_or(0)
                + p["capacity"]["long"].as_u64().unwrap_or(0);
            if let Some(max) = p["max_in_flight"].as_u64().filter(|m| *m < lanes_total) {
                notes.push(format!(
                    "{name}: at most {max} in flight (max_concurrency), below its lanes' {lanes_total}"
                ));
            }
            if let Some(error) = p["last_error"].as_str() {
                let ago = p["last_error_unix_ms"]
                    .as_u64()
                    .map(|at| format!(" ({}s ago)", now_ms().saturating_sub(at) / 1000))
                    .unwrap_or_default();
                notes.push(format!("{name}: last failed probe{ago}: {error}"));
            }
        }
    }
    if !notes.is_empty() {
        println!();
        for note in notes {
            println!("{note}");
        }
    }
    let nodes: Vec<&Value> = body["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|n| n["transport"].is_string())
        .collect();
    if !nodes.is_empty() {
        println!();
        println!(
            "{:<16} {:<10} {:<20} {:<20} {:<10} VERSION",
            "NODE", "LINK", "CREDENTIAL", "CREDENTIAL EXPIRES", "HEARTBEAT"
        );
        for node in nodes {
            let expires = node["credential_expires_unix_ms"]
                .as_u64()
                .map_or_else(|| "never".to_string(), expiry);
            let heartbeat = node["heartbeat_age_ms"]
                .as_u64()
                .map_or_else(String::new, |ms| format!("{:.1}s ago", ms as f64 / 1000.0));
            println!(
                "{:<16} {:<10} {:<20} {:<20} {:<10} {}",
                node["id"].as_str().unwrap_or(""),
                node["transport"].as_str().unwrap_or(""),
                node["credential"].as_str().unwrap_or(""),
                expires,
                heartbeat,
                node["version"].as_str().unwrap_or("")
            );
        }
    }
    let groups = body["model_groups"].as_array().cloned().unwrap_or_default();
    if !groups.is_empty() {
        println!();
        println!("{:<24} {:>12} MEMBERS", "MODEL", "WAITING n/l");
        for g in groups {
            let members: Vec<String> = g["members"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|m| {
                    format!(
                        "{}/{}",
                        m["node"].as_str().unwrap_or(""),
                        m["provider"].as_str().unwrap_or("")
                    )
                })
                .collect();
            println!(
                "{:<24} {:>12} {}",
                g["name"].as_str().unwrap_or(""),
                lanes(&g["waiting"]),
                members.join(", ")
            );
        }
    }
    print_fleet(&body);
    Ok(())
}

/// The fleet's live edges, and which of them each node is linked to (edges sharing a
/// store only).
fn print_fleet(body: &Value) {
    let Some(edges) = body["edges"].as_array() else {
        return;
    };
    println!();
    println!("{:<24} {:<24} {:>8} NODES", "EDGE", "NODE ADDRESS", "SEEN");
    for e in edges {
        let me = if e["this_edge"] == true {
            " (this)"
        } else {
            ""
        };
        let linked = e["linked"].as_array().map_or(0, Vec::len);
        println!(
            "{:<24} {:<24} {:>8} {linked}",
            format!("{}{me}", e["id"].as_str().unwrap_or("")),
            e["node_address"].as_str().unwrap_or(""),
            format!(
                "{:.1}s",
                e["seen_ms_ago"].as_i64().unwrap_or(0) as f64 / 1000.0
            ),
        );
    }
    if let Some(error) = body["store_error"].as_str() {
        println!("store: {error}");
    }
    println!();
    println!("{:<16} LINKED TO EDGES", "NODE");
    for node in body["nodes"].as_array().into_iter().flatten() {
        let linked: Vec<&str> = node["edges"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        println!(
            "{:<16} {}",
            node["id"].as_str().unwrap_or(""),
            if linked.is_empty() {
                "-".to_string()
            } else {
                linked.join(", ")
            }
        );
    }
}

/// A Unix-milliseconds expiry as how far away it is.
fn expiry(unix_ms: u64) -> String {
    expiry_at(unix_ms, now_ms())
}

/// A Unix-milliseconds expiry as how far from `now` it is: "in 3h", or "expired".
pub(super) fn expiry_at(unix_ms: u64, now: u64) -> String {
    if unix_ms <= now {
        return "expired".into();
    }
    let secs = (unix_ms - now) / 1000;
    match secs {
        s if s >= 2 * 86_400 => format!("in {}d", s / 86_400),
        s if s >= 2 * 3600 => format!("in {}h", s / 3600),
        s => format!("in {}m", s / 60),
    }
}

pub(super) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

//! `iop status`: prints an edge's `/admin/status` as a table (or raw JSON).

use serde_json::Value;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The edge's HTTP address.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// API key, if the edge requires one.
    #[arg(long, env = "IOP_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Print the JSON snapshot as it is.
    #[arg(long)]
    json: bool,
}

pub async fn run(args: Args) -> super::Result {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let url = format!("{}/admin/status", args.url.trim_end_matches('/'));
    let mut request = reqwest::Client::new().get(&url);
    if let Some(key) = &args.api_key {
        request = request.bearer_auth(key);
    }
    let response = request
        .send()
        .await
        .map_err(|e| format!("cannot reach {url}: {e}"))?;
    let status = response.status();
    let body: Value = response
        .json()
        .await
        .map_err(|e| format!("{url}: not a status snapshot: {e}"))?;
    if !status.is_success() {
        return Err(format!("{url}: {status}: {body}").into());
    }
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
    Ok(())
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
